"""`kvoffload serve --workers N`: one node, N shard processes, one URL (issue 13).

Real daemons with two or three workers; the SDK must reach every shard through the node's port
alone, and everything a one-process daemon promises must still hold: bit-exact data, chained
lookups, batches, restarts on the same data directory, one /metrics and one event stream.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from kvoffload.client_sdk import AsyncClient, Client
from kvoffload.errors import AuthError, KVOffloadError
from kvoffload.wire.native.connection import Hello, NativeConnection, Role
from kvoffload.wire.shards import shard_of
from tests.conftest import Daemon

pytestmark = pytest.mark.integration

WORKERS = ("--workers", "2")


def _chain(n: int, size: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(n)]
    values = [rng.bytes(size) for _ in range(n)]
    return keys, values


def _put_chain(client: Client, keys: list[bytes], values: list[bytes]) -> None:
    parent = None
    for key, value in zip(keys, values, strict=True):
        client.put(key, value, parent=parent)
        parent = key


def _shard_lines(daemon: Daemon) -> list[str]:
    return [line for line in daemon.lines if " shard " in line and "native" in line]


def test_one_url_reaches_every_shard(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon(*WORKERS)
    assert len(_shard_lines(daemon)) == 2
    keys, values = _chain(96, 20_000, seed=1)
    assert {shard_of(k, 2) for k in keys} == {0, 1}  # the chain spans both shards
    with Client.connect(daemon.url()) as client:
        _put_chain(client, keys, values)
        assert client.lookup(keys) == len(keys)
        for key, value in zip(keys, values, strict=True):
            assert bytes(client.get(key) or b"") == value
        # A hole in one shard ends the chain there, whichever shard the rest lives on.
        assert client.delete(keys[40])
        assert client.lookup(keys) == 40
        assert not client.exists(keys[40]) and client.exists(keys[41])
        buffers = [np.zeros(20_000, np.uint8) for _ in keys]
        got = client.get_many_into(keys, buffers)
        for i, (g, buf) in enumerate(zip(got, buffers, strict=True)):
            if i == 40:
                assert g is None and not buf.any()  # a miss leaves the buffer untouched
            else:
                assert g is not None and buf.tobytes() == values[i]
        blocks = client.get_many(keys[:10])
        assert [bytes(b or b"") for b in blocks] == values[:10]
        more_keys, more_values = _chain(40, 5_000, seed=2)
        client.put_many(list(zip(more_keys, more_values, strict=True)))
        assert client.lookup(more_keys) == len(more_keys)
        assert [bytes(b or b"") for b in client.get_many(more_keys)] == more_values
        stats = client.stats().store
    assert stats["shards"] == 2
    assert stats["puts"] == len(keys) + len(more_keys)
    # Each shard holds its own keys: the node's entries add up to every block stored.
    dram = next(t for t in stats["tiers"] if t["name"] == "dram")  # type: ignore[index, union-attr]
    assert dram["entries"] == len(keys) - 1 + len(more_keys)


def test_asyncio_client_routes_too(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon(*WORKERS)
    keys, values = _chain(48, 8_000, seed=3)

    async def main() -> None:
        async with AsyncClient.connect(daemon.url()) as client:
            parent = None
            for key, value in zip(keys, values, strict=True):
                await client.put(key, value, parent=parent)
                parent = key
            assert await client.lookup(keys) == len(keys)
            await client.delete(keys[7])
            assert await client.lookup(keys) == 7
            got = await client.get_many(keys)
            assert got[7] is None
            assert [bytes(g or b"") for i, g in enumerate(got) if i != 7] == [
                v for i, v in enumerate(values) if i != 7
            ]

    asyncio.run(main())
    # The sync client sees what the asyncio one stored.
    with Client.connect(daemon.url()) as client:
        assert bytes(client.get(keys[0]) or b"") == values[0]


def test_a_store_keeps_its_shard_count(start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    data = tmp_path / "store"
    flags = ("--ssd", "64MiB", "--data-dir", str(data))
    keys, values = _chain(40, 30_000, seed=4)
    first = start_daemon(*WORKERS, *flags)
    with Client.connect(first.url()) as client:
        for key, value in zip(keys, values, strict=True):
            client.put(key, value, durable=True)
    assert first.stop() == 0
    assert sorted(p.name for p in data.iterdir()) == ["shard-0", "shard-1", "shards.json"]
    check = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "fsck", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("clean") == 2
    # Restarted on the same directory (here with --workers 0: the store's own count).
    again = start_daemon("--workers", "0", *flags)
    with Client.connect(again.url()) as client:
        assert [bytes(client.get(k) or b"") for k in keys] == values
    again.stop()
    # Another count, or a one-process daemon, is refused before anything is opened.
    for count in ("3", "1"):
        home = tmp_path / f"refused-{count}"
        home.mkdir()
        with pytest.raises(RuntimeError, match="holds a store of 2 shard"):
            Daemon(home, "--workers", count, *flags)


def test_one_metrics_endpoint_and_one_event_stream(start_daemon: Callable[..., Daemon]) -> None:
    context = zmq.Context.instance()
    daemon = start_daemon(*WORKERS, "--events", "tcp://127.0.0.1:0")
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.events)
    time.sleep(0.5)  # a PUB subscription takes a moment to reach the publisher
    keys, values = _chain(30, 4_000, seed=5)
    with Client.connect(daemon.url()) as client:
        _put_chain(client, keys, values)
        for key in keys:
            assert client.get(key) is not None
    stored: list[int] = []
    seqs: list[int] = []
    deadline = time.monotonic() + 20
    while len(stored) < len(keys) and time.monotonic() < deadline:
        if sub.poll(200):
            _, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            for event in msgpack.unpackb(payload)[1]:
                if event["type"] == "BlockStored":
                    stored.extend(event["block_hashes"])
    sub.close(linger=0)
    wanted = {int.from_bytes(k, "big") & ((1 << 64) - 1) for k in keys}
    assert set(stored) == wanted
    assert seqs == list(range(1, len(seqs) + 1))  # one gap-free sequence for the node
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    puts = re.search(
        r'^kvoffload_requests_total\{front="native",op="put",status="ok"\} (\S+)$', text, re.M
    )
    gets = re.search(
        r'^kvoffload_requests_total\{front="native",op="get",status="ok"\} (\S+)$', text, re.M
    )
    assert puts and float(puts.group(1)) == len(keys)
    assert gets and float(gets.group(1)) == len(keys)
    engine_puts = re.search(r"^kvoffload_engine_puts_total (\S+)$", text, re.M)
    assert engine_puts and float(engine_puts.group(1)) == len(keys)
    assert re.search(r"^kvoffload_engine_workers_answering 2\.0$", text, re.M)


def test_a_version_1_client_is_refused_with_a_reason(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon(*WORKERS)
    conn = NativeConnection(Role.CLIENT)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(conn.send(Hello(1, version=1)))
        answer = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert b"upgrade kvoffload" in answer


def test_tenants_and_quotas_span_the_shards(start_daemon: Callable[..., Daemon]) -> None:
    config = """
[tenants.alpha]
token = "secret-a"
quota_bytes = "4MiB"
"""
    daemon = start_daemon(*WORKERS, config=config)
    keys, values = _chain(64, 256 << 10, seed=6)  # 16 MiB offered against a 4 MiB quota
    with Client.connect(daemon.url(token="secret-a")) as client:
        for key, value in zip(keys, values, strict=True):
            client.put(key, value)
        held = client.stats().store["tenant_bytes"]
        hits = sum(client.get(k) is not None for k in keys)
    # Each shard enforces its share (quota / workers): the node never holds more than the
    # quota, and the tenant keeps about as much as the quota allows.
    assert isinstance(held, dict) and 0 < held["alpha"] <= 4 << 20
    assert 8 <= hits <= 16
    with pytest.raises(AuthError):
        Client.connect(daemon.url(token="wrong")).put(keys[0], values[0])


def test_a_dead_worker_takes_the_node_down(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon(*WORKERS)
    children = subprocess.run(
        ["pgrep", "-P", str(daemon.proc.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    workers = [
        int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    assert daemon.proc.wait(60) == 1
    # The other worker was stopped too: nothing serves half a store.
    for pid in workers[1:]:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text()
    assert "exited with status" in daemon.stderr()


def test_a_batch_that_fails_on_one_shard_leaves_nothing_behind(
    start_daemon: Callable[..., Daemon],
) -> None:
    daemon = start_daemon(*WORKERS)
    keys, values = _chain(24, 50_000, seed=7)
    assert {shard_of(k, 2) for k in keys} == {0, 1}
    url = daemon.url(timeout="2", retries="0")
    with Client.connect(url) as client:
        for key, value in zip(keys, values, strict=True):
            client.put(key, value)
        stats = client.stats().store
        assert stats["shards"] == 2
    workers = sorted(
        int(pid)
        for pid in subprocess.run(
            ["pgrep", "-P", str(daemon.proc.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
    frozen = workers[1]  # spawned second: shard 1
    buffers = [np.full(50_000, 0xAA, np.uint8) for _ in keys]
    with Client.connect(url) as client:
        client.exists(keys[0])  # connected to every shard before one stops answering
        os.kill(frozen, signal.SIGSTOP)
        try:
            with pytest.raises(KVOffloadError):
                client.get_many_into(keys, buffers)
        finally:
            os.kill(frozen, signal.SIGCONT)
        # Shard 0 answered, but its blocks are not handed over half a batch: nothing of any
        # value stays in the caller's buffers.
        for buf, value in zip(buffers, values, strict=True):
            assert buf.tobytes() != value and value[:4096] not in buf.tobytes()
        # The shard that answered holds no pin for the failed batch: its blocks can be
        # overwritten and read back.
        for key, value in zip(keys, values, strict=True):
            client.put(key, value[::-1])
        assert [bytes(b or b"") for b in client.get_many(keys)] == [v[::-1] for v in values]


def test_nvme_hosts_reach_every_shard_through_its_subsystem(
    start_daemon: Callable[..., Daemon],
) -> None:
    daemon = start_daemon(*WORKERS)
    ports = [
        int(m.group(2))
        for line in daemon.lines
        if (m := re.match(r"^kvoffload: nvme shard (\d) listening on \S+:(\d+)$", line))
    ]
    assert len(ports) == 2
    nqn = "nqn.2026-11.io.kvoffload:store"
    url = f"nvme+tcp://127.0.0.1:{ports[0]}/{nqn}?ports={ports[0]},{ports[1]}"
    keys, values = _chain(20, 10_000, seed=8)
    with Client.connect(daemon.url()) as native, Client.connect(url) as nvme:
        for key, value in zip(keys[:10], values[:10], strict=True):
            native.put(key, value)
        for key, value in zip(keys[10:], values[10:], strict=True):
            nvme.put(key, value)
        # Both protocols place every key on the same shard: each reads what the other wrote.
        assert [bytes(nvme.get(k) or b"") for k in keys] == values
        assert [bytes(native.get(k) or b"") for k in keys] == values
        assert nvme.lookup(keys) == len(keys)
    # One subsystem alone holds only its shard's keys.
    alone = f"nvme+tcp://127.0.0.1:{ports[1]}/{nqn}.shard1"
    with Client.connect(alone) as shard1:
        held = [shard1.exists(k) for k in keys]
    assert held == [shard_of(k, 2) == 1 for k in keys]


def _free_ports(count: int) -> int:
    """A port P with P..P+count-1 free now (a node's port and its workers' ports)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        held = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no run of free ports")


def test_clients_follow_a_restarted_node(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    port = _free_ports(3)
    keys, values = _chain(16, 10_000, seed=9)
    first = start_daemon("--port", str(port), *WORKERS)
    assert sorted(int(line.rsplit(":", 1)[1]) for line in _shard_lines(first)) == [
        port + 1,
        port + 2,
    ]
    client = Client.connect(f"kv://127.0.0.1:{port}?retries=2&timeout=10")
    for key, value in zip(keys, values, strict=True):
        client.put(key, value)
    assert first.stop() == 0
    # The same port, now one process (DRAM only, so no store holds it to two shards): the
    # client's shard ports are gone, it asks the node's port again and follows.
    again = start_daemon("--port", str(port), "--workers", "1")
    assert client.get(keys[0]) is None  # a fresh DRAM tier
    client.put(keys[0], values[0])
    assert bytes(client.get(keys[0]) or b"") == values[0]
    assert client.stats().store.get("shards") is None
    again.stop()
    # And back to two workers on the same ports: the client's one connection still reaches
    # the node's port, where a worker answers a key it does not hold with WRONG_SHARD, and the
    # client asks for the map again.
    start_daemon("--port", str(port), *WORKERS)
    for key, value in zip(keys, values, strict=True):
        client.put(key, value)
    assert [bytes(client.get(k) or b"") for k in keys] == values
    assert client.stats().store["shards"] == 2
    with Client.connect(f"kv://127.0.0.1:{port}") as fresh:  # every key on its own shard
        assert fresh.lookup(keys) == len(keys)
    client.close()
    with pytest.raises(KVOffloadError, match="closed"):
        client.get(keys[1])


def test_a_missing_shard_is_found_not_recreated(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    data = tmp_path / "store"
    flags = ("--ssd", "64MiB", "--data-dir", str(data))
    first = start_daemon(*WORKERS, *flags)
    with Client.connect(first.url()) as client:
        client.put(bytes(16), b"x" * 5000, durable=True)
    first.stop()
    (data / "shard-1").rename(tmp_path / "elsewhere")
    check = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "fsck", str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 1 and "shard-1" in check.stdout and "missing" in check.stdout
    home = tmp_path / "refused"
    home.mkdir()
    with pytest.raises(RuntimeError, match="shard-1 is missing"):
        Daemon(home, *WORKERS, *flags)
    assert not (data / "shard-1").exists()


def test_a_worker_refuses_keys_it_does_not_hold(start_daemon: Callable[..., Daemon]) -> None:
    from kvoffload.client_sdk.transports.native import NativeOptions, NativeTransport
    from kvoffload.errors import WrongShardError

    daemon = start_daemon(*WORKERS)
    shard0 = int(next(line for line in _shard_lines(daemon) if "shard 0" in line).rsplit(":", 1)[1])
    keys, _ = _chain(20, 1, seed=10)
    mine = next(k for k in keys if shard_of(k, 2) == 0)
    theirs = next(k for k in keys if shard_of(k, 2) == 1)
    direct = NativeTransport(NativeOptions(port=shard0, retries=0))
    try:
        direct.put(mine, [b"ok"], None)
        assert direct.exists(mine)
        for call in (
            lambda: direct.put(theirs, [b"lost?"], None),
            lambda: direct.exists(theirs),
            lambda: direct.get_many([mine, theirs]),
            lambda: direct.lookup([mine, theirs]),
        ):
            with pytest.raises(WrongShardError, match="belongs to shard 1 of 2"):
                call()
        assert direct.exists(mine)  # the connection stays usable
    finally:
        direct.close()
    with Client.connect(daemon.url()) as client:  # the refused put stored nothing anywhere
        assert not client.exists(theirs)


def test_a_silent_worker_counts_with_its_last_stats(start_daemon: Callable[..., Daemon]) -> None:
    """A worker that does not answer a scrape (stopped here: hung, or busy stopping) counts
    with the stats it last gave, so the node's engine counters never go backwards (Prometheus
    would read a drop as a reset and count that worker's share again); the scrape says how
    many answered."""
    daemon = start_daemon(*WORKERS)
    keys = [i.to_bytes(2, "big") * 8 for i in range(1, 13)]
    assert {shard_of(k, 2) for k in keys} == {0, 1}
    with Client.connect(daemon.url()) as client:
        for k in keys:
            client.put(k, b"v" * 100)

    def scrape() -> str:
        with urllib.request.urlopen(daemon.metrics_url, timeout=30) as answer:
            return str(answer.read().decode())

    def puts(text: str) -> float:
        found = re.search(r"^kvoffload_engine_puts_total (\S+)$", text, re.M)
        assert found, text
        return float(found.group(1))

    assert puts(scrape()) == len(keys)  # both answer: each one's last stats recorded
    children = subprocess.run(
        ["pgrep", "-P", str(daemon.proc.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    workers = [
        int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGSTOP)
    try:
        text = scrape()  # waits out one stats timeout
    finally:
        os.kill(workers[0], signal.SIGCONT)
    assert puts(text) == len(keys)
    assert re.search(r"^kvoffload_engine_workers_answering 1\.0$", text, re.M)
    assert re.search(r"^kvoffload_engine_workers_answering 2\.0$", scrape(), re.M)
