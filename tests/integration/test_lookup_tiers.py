"""`lookup(keys, tiers=True)` over every transport: the leading run, block by block, in the tier
that holds it (protocol 4), and what older peers get.

A store's blocks are made SSD-only by a durable put and a reopen (the DRAM tier starts cold);
reading a block promotes it into DRAM, so a test chooses exactly which blocks are where.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from test_client_bad_answers import _joined, peer

from kvoffload.client_sdk import AsyncClient, Client, Tier, TierRun
from kvoffload.wire.native.connection import (
    NEED_DATA,
    Event,
    Hello,
    Lookup,
    LookupResult,
    NativeConnection,
    Role,
)
from kvoffload.wire.native.frames import FrameReader
from kvoffload.wire.shards import shard_of
from tests.conftest import Daemon

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

D, S = Tier.DRAM, Tier.SSD
# Blocks read after the reopen (promoted to DRAM); the others stay SSD-only.
READ = (0, 1, 4, 7)
EXPECTED = [D, D, S, S, D, S, S, D, S, S]


def _chain(n: int = 12) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def _stage(client: Client, keys: list[bytes]) -> None:
    """After a reopen: promote the blocks of READ into DRAM."""
    for i in READ:
        assert client.get(keys[i]) == b"v%d" % i


def _check(run: TierRun, keys: list[bytes]) -> None:
    # keys[10] was never stored: the run ends there.
    assert run.tiers() == EXPECTED and run.total == 10
    assert (run.dram, run.ssd, run.remote, run.unknown) == (4, 6, 0, 0)


def test_local_store_reports_dram_and_ssd(tmp_path: Path) -> None:
    url = f"local://{tmp_path}?dram=8MiB&ssd=16MiB"
    keys = _chain()
    with Client.connect(url) as client:
        client.put_many([(k, b"v%d" % i) for i, k in enumerate(keys[:10])])
        for i, key in enumerate(keys[11:], start=11):  # past the hole: never in the run
            client.put(key, b"v%d" % i, durable=True)
        for i, key in enumerate(keys[:10]):
            client.put(key, b"v%d" % i, durable=True)
        # Fresh puts are in DRAM (a durable put in both tiers: DRAM counts).
        assert client.lookup(keys, tiers=True) == TierRun.of(D, 10)
    with Client.connect(url) as client:
        assert client.lookup(keys, tiers=True) == TierRun.of(S, 10)
        _stage(client, keys)
        run = client.lookup(keys, tiers=True)
        _check(run, keys)
        assert client.lookup(keys) == 10  # the plain form is unchanged
        assert run.slice(2, 6) == TierRun(((S, 2), (D, 1), (S, 1)))

        async def main() -> None:
            async with AsyncClient.connect(url.replace(str(tmp_path), str(tmp_path / "a"))) as a:
                assert await a.lookup(keys, tiers=True) == TierRun()

        asyncio.run(main())


def _daemon_store(tmp_path: Path, *flags: str) -> tuple[list[bytes], Callable[[], Daemon]]:
    """A daemon with an SSD tier holding the chain durably, restarted so its DRAM is cold;
    returns the keys and a starter of the restarted daemon."""
    home = tmp_path / "node"
    home.mkdir()
    args = ("--ssd", "64MiB", *flags)
    keys = _chain()
    first = Daemon(home, *args)
    try:
        with Client.connect(first.url()) as client:
            for i, key in enumerate(keys[:10]):
                client.put(key, b"v%d" % i, durable=True)
            assert client.lookup(keys, tiers=True) == TierRun.of(D, 10)
    finally:
        first.stop()
    return keys, lambda: Daemon(home, *args)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_a_daemon_reports_tiers_over_kv(tmp_path: Path, workers: int) -> None:
    flags = ("--workers", "2") if workers == 2 else ()
    keys, restart = _daemon_store(tmp_path, *flags)
    if workers == 2:  # the chain spans both shards: the router merges in key order
        assert {shard_of(k, 2) for k in keys[:10]} == {0, 1}  # fixed keys: always both
    daemon = restart()
    try:
        with Client.connect(daemon.url()) as client:
            assert client.lookup(keys, tiers=True) == TierRun.of(S, 10)
            _stage(client, keys)
            _check(client.lookup(keys, tiers=True), keys)
            # A hole on either shard ends the run there, with the tiers before it.
            assert client.delete(keys[5])
            assert client.lookup(keys, tiers=True) == TierRun.from_tiers(EXPECTED[:5])

        async def main() -> TierRun:
            async with AsyncClient.connect(daemon.url()) as client:
                return await client.lookup(keys, tiers=True)

        assert asyncio.run(main()) == TierRun.from_tiers(EXPECTED[:5])
        # Over nvme+tcp:// the KV command set has no tiers: the same run, all UNKNOWN.
        if workers == 1:
            with Client.connect(daemon.nvme_url()) as nvme:
                assert nvme.lookup(keys, tiers=True) == TierRun.of(Tier.UNKNOWN, 5)
    finally:
        daemon.stop()


def test_cluster_hits_are_remote(start_daemon: Callable[..., Daemon]) -> None:
    nodes = [start_daemon(), start_daemon()]
    hosts = ",".join(f"127.0.0.1:{d.port}" for d in nodes)
    keys = _chain()
    with Client.connect(f"cluster://{hosts}") as client:
        client.put_many([(k, b"v") for k in keys[:7]])
        assert client.lookup(keys, tiers=True) == TierRun.of(Tier.REMOTE, 7)

        async def main() -> TierRun:
            async with AsyncClient.connect(f"cluster://{hosts}") as a:
                return await a.lookup(keys, tiers=True)

        assert asyncio.run(main()) == TierRun.of(Tier.REMOTE, 7)
    for node in nodes:
        node.stop()
    with Client.connect(f"cluster://{hosts}?timeout=1") as client:  # nobody answers: a miss
        assert client.lookup(keys, tiers=True) == TierRun()


# ---------------------------------------------------------------------------- versions


def _lookup_answer(seen: list[Lookup]) -> Callable[[NativeConnection, Event], tuple[bytes, bool]]:
    def answer(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
        assert isinstance(event, Lookup)
        seen.append(event)
        n = min(3, len(event.keys))
        tiers = (int(Tier.SSD), n) if event.tiers and n else () if event.tiers else None
        return _joined(conn.send_parts(LookupResult(event.request_id, n, tiers))), False

    return answer


def test_a_protocol_3_daemon_is_asked_the_plain_lookup() -> None:
    """A version 3 daemon refuses the version 4 Hello and would refuse a Lookup's unknown
    `tiers` field: the client falls back to 3, sends the plain Lookup and reports the run as
    UNKNOWN. A version 4 daemon is asked for the tiers."""
    keys = _chain(5)
    for speaks, asked, expected in (
        ((1, 2, 3), False, TierRun.of(Tier.UNKNOWN, 3)),
        ((1, 2, 3, 4), True, TierRun.of(Tier.SSD, 3)),
    ):
        seen: list[Lookup] = []
        with peer(_lookup_answer(seen), speaks=speaks) as port:
            url = f"kv://127.0.0.1:{port}?retries=0&timeout=10"
            with Client.connect(url) as client:
                assert client.lookup(keys, tiers=True) == expected
                assert client.lookup(keys) == 3

            async def main(url: str) -> TierRun:
                async with AsyncClient.connect(url) as client:
                    return await client.lookup(keys, tiers=True)

            assert asyncio.run(main(url)) == expected
        assert [e.tiers for e in seen] == [asked, False, asked]


def test_a_protocol_3_client_gets_the_old_answer(start_daemon: Callable[..., Daemon]) -> None:
    """A version 4 daemon serves a version 3 client as before: its LookupResult frame carries
    only `count`, which a version 3 codec (it refuses unknown fields) accepts."""
    daemon = start_daemon()
    keys = _chain(4)
    with Client.connect(daemon.url()) as client:
        client.put_many([(k, b"v") for k in keys[:2]])
    conn = NativeConnection(Role.CLIENT)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(conn.send(Hello(1, version=3)))
        sock.sendall(conn.send(Lookup(2, tuple(keys))))
        reader, raw = FrameReader(), b""
        frames = []
        while len(frames) < 2:
            raw = sock.recv(1 << 16)
            assert raw, "the daemon closed the connection"
            reader.receive_data(raw)
            while (frame := reader.next_frame()) is not NEED_DATA:
                frames.append(frame)
    welcome, answer = frames
    assert welcome.meta["version"] == 3
    assert answer.meta == {"count": 2}
