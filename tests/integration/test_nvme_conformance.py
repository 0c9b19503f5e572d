"""NVMe/TCP conformance, checked by a third party: Debian's tshark and its nvme-tcp dissector.

A full session — a Linux-order bring-up, many Stores and Retrieves (in-capsule, and by R2T and
several H2CData), Exist/List/Delete, the KV status codes, a CC.SHN shutdown — runs against a real
daemon while tshark captures it on loopback, once without and once with header and data
digests. Then (shared/ref/nvme-tcp-kv.md §4) the dissector must find no malformed PDU and no
expert warning, every PDU type of the session must be there, and with digests on every header
and data digest must verify.

Capturing on `lo` needs root (CI runs as root) and `.ci/deps` installs tshark. Without either
this test fails and says why: a conformance check that did not run has not passed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.client_sdk import Client
from kvoffload.client_sdk.transports.nvme import NvmeHost, NvmeOptions
from kvoffload.wire.nvme_tcp.cmd import StoreOption

pytestmark = [pytest.mark.integration, pytest.mark.needs_tshark, pytest.mark.timeout(300)]
Start = Callable[..., Any]

# Small capsules and data PDUs, so that a few hundred KiB exercise every data path.
CONFIG = """
[nvme]
in_capsule_bytes = "16KiB"
maxh2cdata_bytes = "16KiB"
max_c2h_bytes = "64KiB"
"""
SIZES = (100, 4096, 15_000, 100_000)  # the last ones travel by R2T: 7 H2CData each
ROUNDS = 5
IC_AND_TERM = {"0", "1", "2", "3"}  # these PDUs never carry digests


def _tshark() -> str:
    path = shutil.which("tshark")
    if path is None:
        pytest.fail(
            "tshark is not installed, so the NVMe/TCP conformance check cannot run: "
            "`apt-get install tshark` (.ci/deps does this when it runs as root)"
        )
    return path


@contextlib.contextmanager
def _capture(port: int, out: Path) -> Iterator[None]:
    """tshark capturing `tcp port <port>` on loopback into `out` while the block runs."""
    proc = subprocess.Popen(
        [_tshark(), "-i", "lo", "-f", f"tcp port {port}", "-B", "64", "-w", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: [lines.put(line) for line in proc.stderr or ()], daemon=True
    )
    reader.start()
    said: list[str] = []
    deadline = time.monotonic() + 60
    while not any("Capturing on" in line for line in said):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            reader.join(5)
            while not lines.empty():
                said.append(lines.get())
            pytest.fail(
                "tshark cannot capture on the loopback interface (capturing needs root or "
                f"dumpcap with cap_net_raw): {''.join(said).strip()}"
            )
        with contextlib.suppress(queue.Empty):
            said.append(lines.get(timeout=0.2))
    time.sleep(1.0)  # dumpcap has opened the interface; let it settle before traffic starts
    try:
        yield
    finally:
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if not out.exists():
        pytest.fail(f"tshark wrote no capture: {''.join(said).strip()}")


def _session(port: int, digests: bool) -> dict[str, int]:
    """The scenario; returns how many KV commands of each kind it ran."""
    host = NvmeHost(NvmeOptions(port=port, hdgst=digests, ddgst=digests, queues=2, depth=8))
    counts: collections.Counter[str] = collections.Counter()
    try:
        stored = []
        for i in range(ROUNDS * len(SIZES)):
            key, value = os.urandom(16), os.urandom(SIZES[i % len(SIZES)])
            assert host.store(key, [value]).ok
            counts["r2t stores" if len(value) > 16 << 10 else "stores"] += 1
            stored.append((key, value))
        for key, value in stored:
            c, data = host.retrieve(key, len(value))
            assert c.ok and data == value
        c, data = host.retrieve(stored[3][0], 1000)  # a short host buffer
        assert c.ok and c.dw0 == len(stored[3][1]) and data == stored[3][1][:1000]
        assert host.exist(stored[0][0]).ok
        c, listed = host.list(b"", 4096)
        assert c.ok and sorted(k for k, _ in stored) == listed
        assert host.delete(stored[0][0]).ok
        assert (host.exist(stored[0][0]).sc, host.delete(stored[0][0]).sc) == (0x87, 0x87)
        absent = host.store(stored[1][0], [b"x"], options=StoreOption.ONLY_IF_ABSENT)
        assert absent.sc == 0x89
    finally:
        host.close()  # CC.SHN, CSTS.SHST, then the sockets close
    # The SDK's own path over the same front, blocks sealed and verified end to end.
    query = "?hdgst=1&ddgst=1" if digests else ""
    with Client.connect(f"nvme+tcp://127.0.0.1:{port}/nqn.2026-11.io.kvoffload:store{query}") as c:
        blocks = {os.urandom(16): os.urandom(n) for n in (10, 20_000, 70_000)}
        c.put_many(list(blocks.items()))
        assert c.get_many(list(blocks)) == list(blocks.values())
        assert c.lookup(list(blocks)) == len(blocks)
    return dict(counts)


def _fields(
    capture: Path, port: int, display: str, *fields: str, digests: bool = False
) -> list[list[str]]:
    args = [_tshark(), "-r", str(capture), "-d", f"tcp.port=={port},nvme-tcp"]
    if digests:
        args += ["-o", "nvme-tcp.check_hdgst:TRUE", "-o", "nvme-tcp.check_ddgst:TRUE"]
    if fields:
        args += ["-T", "fields", "-E", "separator=\t"]
        for name in fields:
            args += ["-e", name]
    args += ["-Y", display]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return [line.split("\t") for line in proc.stdout.splitlines() if line.strip()]


def _values(rows: list[list[str]], column: int) -> list[str]:
    """The column's values, one per PDU (tshark joins several PDUs of a frame with commas)."""
    return [v for row in rows for v in row[column].split(",") if v != ""]


@pytest.mark.parametrize("digests", [False, True], ids=["plain", "digests"])
def test_tshark_finds_the_session_conformant(
    start_daemon: Start, tmp_path: Path, digests: bool
) -> None:
    daemon = start_daemon("--dram", "128MiB", config=CONFIG)
    port = daemon.ports["nvme"]
    capture = tmp_path / "nvme.pcapng"
    with _capture(port, capture):
        counts = _session(port, digests)

    lost = _fields(capture, port, "tcp.analysis.lost_segment || tcp.analysis.ack_lost_segment")
    assert not lost, "the capture dropped packets: the check would be incomplete"
    bad = _fields(
        capture, port, "(_ws.malformed || _ws.expert.severity >= warning) && !tcp.analysis.flags"
    )
    assert not bad, f"tshark reports malformed PDUs or warnings: {bad[:5]}"

    rows = _fields(
        capture,
        port,
        "nvme-tcp",
        "nvme-tcp.type",
        "nvme-tcp.plen",
        "nvme-tcp.hdgst.status",
        "nvme-tcp.ddgst.status",
        digests=True,
    )
    types = _values(rows, 0)
    plens = _values(rows, 1)
    assert len(types) == len(plens)
    seen = collections.Counter(types)
    # ICReq/ICResp per connection, commands and completions, R2T and data both ways.
    for ptype in ("0", "1", "4", "5", "6", "7", "9"):
        assert seen[ptype], f"no PDU of type {ptype} in the capture: {seen}"
    assert seen["0"] == seen["1"] and "2" not in seen and "3" not in seen  # no TermReq
    assert seen["9"] >= counts["r2t stores"] and seen["6"] >= 7 * counts["r2t stores"]
    assert seen["4"] == seen["5"] + 2  # every command answered but two parked AERs (two hosts)

    if digests:
        bad = _fields(
            capture,
            port,
            "nvme-tcp.hdgst.status == 0 || nvme-tcp.ddgst.status == 0 || "
            "nvme-tcp.hdgst.status == 4 || nvme-tcp.ddgst.status == 4",
            digests=True,
        )
        assert not bad, f"tshark finds bad digests: {bad[:5]}"
        hdgst, ddgst = _values(rows, 2), _values(rows, 3)
        digested = [t for t in types if t not in IC_AND_TERM]
        # A PDU carries data if it is H2C/C2HData, or a command longer than header + digest.
        with_data = [
            t
            for t, n in zip(types, plens, strict=True)
            if t in ("6", "7") or (t == "4" and int(n) > 76)
        ]
        assert hdgst.count("1") == len(digested) == len(hdgst), collections.Counter(hdgst)
        assert ddgst.count("1") == len(with_data) == len(ddgst), collections.Counter(ddgst)
    else:
        assert not _values(rows, 2) and not _values(rows, 3)  # nothing claims a digest
