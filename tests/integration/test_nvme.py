"""The NVMe/TCP KV front of a real `kvoffload serve`, driven by the SDK's `nvme+tcp://` host and
by bare PDUs: bring-up, every KV command and option, access control, isolation of hosts and
namespaces, keep-alive, AERs, shutdown and disconnect."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from nvme_raw import CC_ENABLE, SUBNQN, RawQueue

from kvoffload.client_sdk import AsyncClient, Client, Namespace, block_keys
from kvoffload.client_sdk.transports.nvme import NvmeHost, NvmeOptions
from kvoffload.errors import AuthError, ConfigError, InvalidArgumentError
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.cmd import StoreOption
from kvoffload.wire.nvme_tcp.connection import CapsuleCmd, CapsuleResp, ConnectionClosed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NS = Namespace("org/model", block_tokens=4, num_layers=2, num_kv_heads=2, head_size=8)
Start = Callable[..., Any]
HOST_A = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001"
HOST_B = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-000000000002"
MISS = (0, 0x87)


def _blocks(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]


def _status(c: nc.Completion) -> tuple[int, int]:
    return c.sct, c.sc


@pytest.mark.parametrize("digests", ["0", "1"])
def test_sdk_round_trips_blocks(start_daemon: Start, digests: str) -> None:
    daemon = start_daemon("--dram", "256MiB")
    keys = block_keys(NS, list(range(64)))
    blocks = _blocks(len(keys), NS.block_bytes)
    url = daemon.nvme_url(hdgst=digests, ddgst=digests, queues="3", depth="8")
    with Client.connect(url, namespace=NS) as client:
        client.put(keys[0], blocks[0])
        client.put_many(zip(keys[1:], blocks[1:], strict=True), parents=list(keys[:-1]))
        assert client.lookup(keys) == len(keys)  # pipelined Exist commands
        assert client.exists(keys[5]) and not client.exists(bytes(16))
        out = np.empty(NS.block_bytes, dtype=np.uint8)
        for key, block in zip(keys, blocks, strict=True):
            assert client.get_into(key, out) == NS.block_bytes
            assert np.array_equal(out, block)
        got = client.get_many([*keys[:10], bytes(16)])
        assert got[:10] == [b.tobytes() for b in blocks[:10]] and got[10] is None
        # More Retrieves than 3 queues x depth 8 in flight: queued, each into its buffer.
        outs = [np.empty(NS.block_bytes, dtype=np.uint8) for _ in range(len(keys) + 1)]
        lengths = client.get_many_into([*keys, bytes(16)], outs)
        assert lengths == [NS.block_bytes] * len(keys) + [None]
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks, strict=False))
        assert client.delete(keys[7]) and not client.delete(keys[7])
        assert client.lookup(keys) == 7 and client.get(keys[7]) is None
        assert client.prefetch(keys) == len(keys) - 1
        # Larger than the 2 MiB capsule: the target fetches it with R2T + H2CData.
        big = np.frombuffer(os.urandom(9 << 20), dtype=np.uint8)
        client.put(keys[0], big)
        assert client.get(keys[0]) == big.tobytes()
        small = bytearray(b"untouched" * 10)
        with pytest.raises(InvalidArgumentError, match="too small"):
            client.get_into(keys[0], small)
        assert small == bytearray(b"untouched" * 10)  # nothing was written into it
        stats = client.stats()
        assert stats.corrupt_blocks == 0 and stats.puts == len(keys) + 1
        assert stats.store["transport"] == "nvme+tcp" and stats.store["used_bytes"]


def test_small_capsules_move_values_by_r2t(start_daemon: Start) -> None:
    daemon = start_daemon(
        config='[nvme]\nin_capsule_bytes = "4KiB"\nmaxh2cdata_bytes = "8KiB"\n'
        'max_c2h_bytes = "16KiB"\n'
    )
    values = [os.urandom(n) for n in (1, 4000, 4096 - 96, 50_000, 1 << 20)]
    keys = [os.urandom(16) for _ in values]
    with Client.connect(daemon.nvme_url(hdgst="1", ddgst="1")) as client:
        client.put_many(list(zip(keys, values, strict=True)))
        assert client.get_many(keys) == values  # C2HData split in 16 KiB PDUs, reassembled
        for key, value in zip(keys, values, strict=True):
            out = bytearray(len(value))
            assert client.get_into(key, out) == len(value) and out == value


def test_async_client(start_daemon: Start) -> None:
    daemon = start_daemon()
    keys = [os.urandom(16) for _ in range(20)]

    async def main() -> None:
        async with AsyncClient.connect(daemon.nvme_url()) as client:
            await asyncio.gather(*(client.put(k, k * 100) for k in keys))
            got = await asyncio.gather(*(client.get(k) for k in keys))
            assert got == [k * 100 for k in keys]
            assert await client.lookup(keys) == len(keys)

    asyncio.run(main())


def test_native_and_nvme_hosts_share_one_store(start_daemon: Start) -> None:
    daemon = start_daemon()
    with Client.connect(daemon.url()) as native, Client.connect(daemon.nvme_url()) as nvme:
        a, b = os.urandom(16), os.urandom(16)
        native.put(a, b"from kv://")
        nvme.put(b, b"from nvme+tcp://")
        assert nvme.get(a) == b"from kv://" and native.get(b) == b"from nvme+tcp://"


def test_many_threads_share_the_queues(start_daemon: Start) -> None:
    daemon = start_daemon("--dram", "256MiB")
    errors: list[BaseException] = []
    with Client.connect(daemon.nvme_url(queues="2", depth="4")) as client:

        def work(seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                for i in range(30):
                    key = rng.bytes(16)
                    # Three sizes: every size class takes slabs, and many classes in a small
                    # arena would evict each other, which is not what this test is about.
                    value = rng.bytes((1000, 50_000, 300_000)[i % 3])
                    client.put(key, value)
                    assert client.get(key) == value
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert client.stats().corrupt_blocks == 0
    assert not errors, errors


# Hosts and namespaces of the open store (no tenants: with tenants the NVMe front does not run).
ISOLATED = f"""
[nvme.subsystems."{SUBNQN}"]
allow_hosts = ["{HOST_A}", "{HOST_B}"]
[nvme.subsystems."{SUBNQN}".namespaces.1]
hosts = ["{HOST_A}"]
[nvme.subsystems."{SUBNQN}".namespaces.2]
hosts = ["{HOST_B}"]
"""
TENANTS = """
[tenants.alice]
token = "alice-secret"
[tenants.bob]
token = "bob-secret"
"""


def test_hosts_see_only_their_namespaces(start_daemon: Start) -> None:
    daemon = start_daemon(config=ISOLATED)
    key = os.urandom(16)
    with Client.connect(daemon.nvme_url(hostnqn=HOST_A)) as a:
        a.put(key, b"a block")
        assert a.get(key) == b"a block"
    with pytest.raises(ConfigError, match="no namespace 2"):
        NvmeHost(NvmeOptions(port=daemon.ports["nvme"], hostnqn=HOST_A, nsid=2))
    with pytest.raises(AuthError):
        NvmeHost(NvmeOptions(port=daemon.ports["nvme"], hostnqn="nqn.2026-01.org.x:intruder"))
    # Commands naming the other host's namespace fail as Invalid Namespace.
    host = NvmeHost(NvmeOptions(port=daemon.ports["nvme"], hostnqn=HOST_A))
    try:
        c, _ = host.io_command(lambda cid: nc.kv_exist(cid, 2, key))
        assert _status(c) == (0, 0x0B)
    finally:
        host.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tenants_keep_the_default_nvme_front_closed(start_daemon: Start) -> None:
    """The trust issue's attack: with tenants, a local process reached alice's engine keys
    through the NVMe front (no token there) and forged her blocks. With tenants configured the
    default NVMe front does not listen at all; the native front still asks for tokens."""
    port = _free_port()
    daemon = start_daemon("--nvme-port", str(port), config=TENANTS)
    assert "nvme" not in daemon.ports and "native" in daemon.ports
    with Client.connect(daemon.url(token="alice-secret")) as alice:
        alice.put(b"k" * 16, b"alice's block")
        assert alice.get(b"k" * 16) == b"alice's block"
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), 5):
        pass
    daemon.stop()
    assert "NVMe/TCP front not started" in daemon.stderr()


@pytest.mark.parametrize(
    ("toml", "env"),
    [
        (TENANTS + "[nvme]\nenabled = true\n", {}),
        (TENANTS, {"KVOFFLOAD_NVME__ENABLED": "true"}),
        (TENANTS + f'[nvme.subsystems."{SUBNQN}".namespaces.1]\ntenant = "alice"\n', {}),
        (TENANTS + ISOLATED, {}),
    ],
    ids=["enabled", "environment", "tenant-namespace", "subsystems"],
)
def test_an_nvme_front_asked_for_with_tenants_is_refused(
    tmp_path: Path, toml: str, env: dict[str, str]
) -> None:
    config = tmp_path / "kvoffload.toml"
    config.write_text(toml)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "serve", "--port", "0", "--nvme-port", "0"]
        + ["--metrics-port", "0", "--dram", "16MiB", "--ssd", "0", "--config", str(config)]
        + ["--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environ, **env},
    )
    assert proc.returncode != 0
    assert "the NVMe/TCP front cannot run with [tenants]" in proc.stderr
    assert "nvme.enabled = false" in proc.stderr
    assert "Traceback" not in proc.stderr and "listening" not in proc.stdout


def test_refused_connects_say_why(start_daemon: Start) -> None:
    daemon = start_daemon(config=ISOLATED)
    port = daemon.ports["nvme"]
    q = RawQueue(port)
    c = q.connect(hostnqn="nqn.2026-01.org.x:intruder")
    assert _status(c) == (1, 0x84) and c.dnr  # Connect Invalid Host
    assert c.dw0 == 512 | (1 << 16)  # IPO: HOSTNQN in the Connect data (IATTR 1)
    c = q.connect(subnqn="nqn.2026-01.org.x:nothing-here", hostnqn=HOST_A)
    assert _status(c) == (1, 0x82) and c.dw0 == 256 | (1 << 16)  # SUBNQN
    c = q.connect(hostnqn=HOST_A, cntlid=5)  # admin queues take a dynamic controller id
    assert _status(c) == (1, 0x82) and c.dw0 == 16 | (1 << 16)
    c, _ = q.command(nc.identify(q.cid(), nd.Cns.CONTROLLER))
    assert _status(c) == (0, 0x0C)  # nothing but Connect before Connect
    c = q.connect(hostnqn=HOST_A)
    assert c.ok and c.dw0 > 0
    cntlid = c.dw0
    io = RawQueue(port)
    c = io.connect(1, hostnqn=HOST_A, cntlid=cntlid)
    assert _status(c) == (0, 0x0C)  # the controller is not enabled yet
    q.enable()
    c = io.connect(17, hostnqn=HOST_A, cntlid=cntlid)
    assert _status(c) == (1, 0x82) and c.dw0 == 42  # QID: past the subsystem's 16 queues
    c, _ = q.command(nc.set_features(q.cid(), 0x07, 0))  # one I/O queue
    assert c.ok
    c = io.connect(2, hostnqn=HOST_A, cntlid=cntlid)
    assert _status(c) == (1, 0x82) and c.dw0 == 42  # QID: past the one granted
    c = io.connect(1, hostnqn=HOST_B, cntlid=cntlid)
    assert _status(c) == (1, 0x82) and c.dw0 == 16 | (1 << 16)  # not B's controller
    assert io.connect(1, hostnqn=HOST_A, cntlid=cntlid).ok
    again = RawQueue(port)
    assert _status(again.connect(1, hostnqn=HOST_A, cntlid=cntlid)) == (1, 0x82)  # taken
    for raw in (q, io, again):
        raw.close()


def _host(daemon: Any, **kw: Any) -> NvmeHost:
    return NvmeHost(NvmeOptions(port=daemon.ports["nvme"], **kw))


def test_kv_commands_follow_the_spec(start_daemon: Start) -> None:
    daemon = start_daemon()
    host = _host(daemon, kato_ms=0)
    try:
        key, other = os.urandom(16), os.urandom(16)
        assert _status(host.exist(key)) == MISS and _status(host.delete(key)) == MISS
        c, data = host.retrieve(key, 100)
        assert _status(c) == MISS and data == b""
        value = os.urandom(5000)
        assert host.store(key, [value]).ok
        assert host.exist(key).ok
        # Only-if-absent on a present key, only-if-exists on an absent one.
        assert _status(host.store(key, [b"x"], options=StoreOption.ONLY_IF_ABSENT)) == (0, 0x89)
        assert _status(host.store(other, [b"x"], options=StoreOption.ONLY_IF_EXISTS)) == MISS
        assert not host.exist(other).ok and host.retrieve(key, 5000)[1] == value
        assert host.store(key, [b"new"], options=StoreOption.ONLY_IF_EXISTS).ok
        assert host.store(other, [b"first"], options=StoreOption.ONLY_IF_ABSENT).ok
        both = StoreOption.ONLY_IF_EXISTS | StoreOption.ONLY_IF_ABSENT
        assert _status(host.store(other, [b"x"], options=both)) == (0, 0x02)
        # A short host buffer: the value's first bytes, and DW0 = the whole value's size.
        assert host.store(key, [value]).ok
        c, data = host.retrieve(key, 1000)
        assert c.ok and c.dw0 == 5000 and data == value[:1000]
        # Key sizes: 1..16 bytes; 0 and 17+ are Invalid Key Size.
        assert (
            host.store(b"k", [b"one byte key"]).ok and host.retrieve(b"k", 64)[1] == b"one byte key"
        )
        assert _status(host.exist(b"k\0")) == MISS  # a different key, not a padded one
        for kl in (0, 17):
            c, _ = host.io_command(
                lambda cid, kl=kl: _with_key_length(nc.kv_exist(cid, host.nsid, key), kl)
            )
            assert _status(c) == (0, 0x86)
        # Value size: CDW10 must match the SGL, and fit the namespace.
        c, _ = host.io_command(
            lambda cid: _replace(nc.kv_store(cid, host.nsid, key, 10, in_capsule=True), cdw10=11),
            [bytes(10)],
        )
        assert _status(c) == (0, 0x85)
        too_big = host.namespace.max_value + 1
        c, _ = host.io_command(
            lambda cid: nc.kv_store(cid, host.nsid, key, too_big, in_capsule=False)
        )
        assert _status(c) == (0, 0x85)
        assert host.retrieve(key, 5000)[1] == value  # failed stores changed nothing
    finally:
        host.close()


def _replace(cmd: nc.Command, **fields: int) -> nc.Command:
    return dataclasses.replace(cmd, **fields)


def _with_key_length(cmd: nc.Command, kl: int) -> nc.Command:
    return _replace(cmd, cdw11=(cmd.cdw11 & ~0xFF) | kl)


def test_list_pages_through_the_keys(start_daemon: Start) -> None:
    daemon = start_daemon()
    host = _host(daemon, kato_ms=0)
    try:
        keys = sorted({os.urandom(16) for _ in range(40)} | {b"a", b"ab", b"\xff" * 16})
        for key in keys:
            assert host.store(key, [b"v"]).ok
        c, listed = host.list(b"", 4096)
        assert c.ok and listed == keys and c.dw0 == len(keys)
        # A small buffer returns a prefix; asking again from the last key pages on.
        seen: list[bytes] = []
        start = b""
        while True:
            c, page = host.list(start, 4 + 5 * 20)
            assert c.ok and c.dw0 == len(page) <= 5 + 2  # 20 B per 16-byte key, 4 per short one
            page = [k for k in page if k != start or not seen]
            if not page:
                break
            seen += page
            start = page[-1]
        assert seen == keys
        assert host.list(keys[10], 4096)[1] == keys[10:]  # from a start key, inclusive
        assert _status(host.delete(keys[3])) == (0, 0) and keys[3] not in host.list(b"", 4096)[1]
        c, _ = host.list(b"", 3)
        assert _status(c) == (0, 0x02)  # no room for the key count
    finally:
        host.close()


def test_keep_alive_timeout_tears_the_association_down(start_daemon: Start) -> None:
    daemon = start_daemon()
    port = daemon.ports["nvme"]
    admin = RawQueue(port)
    c = admin.connect(kato_ms=500)
    assert c.ok
    cntlid = c.dw0
    admin.enable()
    c, _ = admin.command(nc.set_features(admin.cid(), 0x07, 0))
    assert c.ok
    io = RawQueue(port)
    assert io.connect(1, cntlid=cntlid).ok
    # No Keep Alive: the target drops the controller and closes every queue of it.
    assert isinstance(admin.until_closed()[-1], ConnectionClosed)
    assert isinstance(io.until_closed()[-1], ConnectionClosed)
    admin.close()
    io.close()
    # A host that keeps alive keeps its association well past KATO.
    with Client.connect(daemon.nvme_url(kato="1500")) as client:  # Keep Alive every 0.5 s
        client.put(b"k" * 16, b"alive")
        before = client.stats().store["cntlid"]
        time.sleep(4.0)
        assert client.get(b"k" * 16) == b"alive"
        assert client.stats().store["cntlid"] == before  # the same association, no reconnect


def test_aer_is_parked_and_disconnect_ends_the_queue(start_daemon: Start) -> None:
    daemon = start_daemon()
    q = RawQueue(daemon.ports["nvme"])
    c = q.connect()
    assert c.ok
    q.enable()
    assert q.command(nc.set_features(q.cid(), 0x07, 0))[0].ok
    io = RawQueue(daemon.ports["nvme"])
    assert io.connect(1, cntlid=c.dw0).ok
    for _ in range(4):  # Identify AERL = 3: four may be outstanding
        q.send(_capsule(nc.async_event(q.cid())))
    c, _ = q.command(nc.keep_alive(q.cid()))
    assert c.ok  # answered while the AERs stay parked
    c, _ = q.command(nc.async_event(q.cid()))
    assert _status(c) == (1, 0x05)  # a fifth: Asynchronous Event Request Limit Exceeded
    c, _ = q.command(nc.property_get(q.cid(), 0x1C, False))
    assert c.dw0 == 1
    bye = nc.disconnect(q.cid())
    q.send(_capsule(bye))
    events = q.until_closed()
    answers = [e.completion.cid for e in events if isinstance(e, CapsuleResp)]
    assert answers == [bye.cid]  # Disconnect answered, the parked AERs never
    # The admin queue was the association: its I/O queue goes with it.
    assert isinstance(io.until_closed()[-1], ConnectionClosed)
    q.close()
    io.close()


def _capsule(cmd: nc.Command) -> CapsuleCmd:
    return CapsuleCmd(cmd)


def test_shutdown_reports_complete(start_daemon: Start) -> None:
    daemon = start_daemon()
    q = RawQueue(daemon.ports["nvme"])
    assert q.connect().ok
    q.enable()
    c, _ = q.command(nc.property_set(q.cid(), 0x14, CC_ENABLE | (1 << 14)))
    assert c.ok
    c, _ = q.command(nc.property_get(q.cid(), 0x1C, False))
    assert c.dw0 == 0x9  # RDY, SHST = shutdown complete
    c, _ = q.command(nc.keep_alive(q.cid()))
    assert _status(c) == (0, 0x0C)  # a shut-down controller takes no more commands
    q.close()
    host = _host(daemon)
    host.store(b"s" * 16, [b"x"])
    host.close()  # CC.SHN, waits for SHST, closes: no error


def test_identify_as_a_linux_host_reads_it(start_daemon: Start) -> None:
    daemon = start_daemon()
    host = _host(daemon, kato_ms=0)
    try:
        assert host.controller.subnqn == SUBNQN and host.controller.cntlid == host.cntlid
        assert host.version == 0x00020000 and host.nsid == 1
        assert host.namespace.max_value > 1 << 20 and host.namespace.max_key == 16
        c, raw = host.admin_command(lambda cid: nc.get_log_page(cid, nd.Lid.SMART, 512))
        assert c.ok and len(raw) == 512
        c, _ = host.admin_command(lambda cid: nc.get_log_page(cid, 0x70, 512))  # discovery
        assert _status(c) == (1, 0x09)
        c, _ = host.admin_command(lambda cid: nc.identify(cid, nd.Cns.CSI_CONTROLLER, csi=2))
        assert _status(c) == (0, 0x02)  # no ZNS: SPDK's host relies on this failing
        c, _ = host.admin_command(lambda cid: nc.get_features(cid, 0x0F))
        assert c.ok and c.dw0 == 0
        c, _ = host.admin_command(lambda cid: nc.Command(0xC0, cid))  # vendor specific
        assert _status(c) == (0, 0x01)
    finally:
        host.close()


def test_blocks_tier_to_the_ssd_and_back_through_nvme(start_daemon: Start) -> None:
    # 32 MiB of DRAM cannot hold 64 blocks of 900 KiB: reads come back from the SSD tier,
    # on the daemon's I/O threads.
    daemon = start_daemon(
        "--dram", "32MiB", "--ssd", "256MiB", env={"KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1"}
    )
    blocks = {i.to_bytes(16, "big"): os.urandom(900 << 10) for i in range(64)}
    with Client.connect(daemon.nvme_url()) as client:
        for key, value in blocks.items():
            client.put(key, value)
        for key, value in blocks.items():
            assert client.get(key) == value
        assert client.lookup(list(blocks)) == len(blocks)
    with Client.connect(daemon.url()) as native:
        (dram, ssd) = native.stats().store["tiers"]  # type: ignore[misc]
        assert ssd["promotions"] > 0 and ssd["corrupt_blocks"] == 0


def test_kv_events_for_nvme_stores_and_deletes(start_daemon: Start) -> None:
    daemon = start_daemon("--events", "tcp://127.0.0.1:*")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.events)
    key = bytes(range(16))
    host = _host(daemon, kato_ms=0)
    try:
        for _ in range(100):  # PUB drops messages until the subscription has propagated
            host.store(key, [b"v"])
            if sub.poll(100):
                break
        events = msgpack.unpackb(sub.recv_multipart()[2])[1]
        assert events[0]["type"] == "BlockStored"
        assert events[0]["block_hashes"] == [int.from_bytes(key[8:], "big")]
        assert host.delete(key).ok
        removed = False
        while not removed and sub.poll(5000):
            for event in msgpack.unpackb(sub.recv_multipart()[2])[1]:
                removed = removed or event["type"] == "BlockRemoved"
        assert removed
    finally:
        host.close()
        sub.close(linger=0)
