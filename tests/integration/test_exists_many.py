"""`exists_many(keys)` over every transport against real stores: each key answers for itself
(a missing key hides nothing after it), in the order asked, sync and asyncio; a store that
cannot be reached answers all False and logs it, as `exists` does.

Over `kv://` the call is a pipelined run of the protocol's Exists requests (no new frame): the
daemon's counters show one Exists per key, answered by its C hot path, and no Lookup.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from test_daemon import _self_signed

from kvoffload.bench.common import free_port
from kvoffload.client_sdk import AsyncClient, Client
from kvoffload.client_sdk.transports import open_async_transport, open_transport
from kvoffload.client_sdk.transports.native import aio, session, sync
from kvoffload.client_sdk.transports.native.plans import EXISTS_RUN
from kvoffload.client_sdk.url import parse_url
from kvoffload.errors import InvalidArgumentError, LocalProtocolError
from tests.conftest import Daemon

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# More keys than one step of pipelined Exists requests, so a call spans several steps.
N = 2 * EXISTS_RUN + 7


def _keys(n: int = N) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def _stored(i: int) -> bool:
    # Holes at the front, in runs and alone: a prefix count would stop at the first.
    return i % 3 != 0 and i % 7 != 1


def _fill(client: Client, keys: list[bytes]) -> list[bool]:
    client.put_many([(k, b"v%d" % i) for i, k in enumerate(keys) if _stored(i)])
    return [_stored(i) for i in range(len(keys))]


def _async_answer(url: str, keys: list[bytes]) -> list[bool]:
    async def main() -> list[bool]:
        async with AsyncClient.connect(url) as client:
            return await client.exists_many(keys)

    return asyncio.run(main())


def _server(client: Client) -> dict[str, object]:
    server = client.stats().store["server"]
    assert isinstance(server, dict)
    return server


def test_local_store_answers_each_key() -> None:
    keys = _keys()
    with Client.connect("local://") as client:
        expected = _fill(client, keys)
        assert client.exists_many(keys) == expected
        assert client.exists_many(keys) == [client.exists(k) for k in keys]
        assert client.exists_many([]) == []
        with pytest.raises(InvalidArgumentError):
            client.exists_many([keys[0], b"short"])

        async def main() -> list[bool]:
            async with AsyncClient.connect("local://") as other:  # another, empty store
                return await other.exists_many(keys[:5])

        assert asyncio.run(main()) == [False] * 5


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_a_daemon_answers_each_key_over_kv(
    start_daemon: Callable[..., Daemon], workers: int
) -> None:
    daemon = start_daemon("--workers", str(workers)) if workers > 1 else start_daemon()
    keys = _keys()
    with Client.connect(daemon.url()) as client:
        expected = _fill(client, keys)
        before = _server(client) if workers == 1 else {}
        assert client.exists_many(keys) == expected
        if workers == 1:
            # One Exists request per key, every one answered in C; no Lookup was sent.
            after = _server(client)
            assert after["hot_exists"] == int(before["hot_exists"]) + N  # type: ignore[call-overload]
            assert after["hot_lookups"] == before["hot_lookups"]
        # A deleted key turns False, and only that key.
        present = expected.index(True)
        assert client.delete(keys[present])
        expected[present] = False
        assert client.exists_many(keys) == expected
    assert _async_answer(daemon.url(), keys) == expected


def test_a_daemon_answers_each_key_over_tls(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    # An SSL socket has no sendmsg: a step's frames go out joined, in one sendall.
    cert, key = _self_signed(tmp_path)
    daemon = start_daemon("--tls-cert", str(cert), "--tls-key", str(key))
    url = daemon.url(tls="1", ca=str(cert), server_name="localhost")
    keys = _keys()
    with Client.connect(url) as client:
        expected = _fill(client, keys)
        assert client.exists_many(keys) == expected
    assert _async_answer(url, keys) == expected


def test_a_daemon_answers_each_key_over_nvme(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon()
    keys = _keys()
    with Client.connect(daemon.url()) as client:
        expected = _fill(client, keys)
    with Client.connect(daemon.nvme_url()) as nvme:
        assert nvme.exists_many(keys) == expected
    assert _async_answer(daemon.nvme_url(), keys) == expected


def test_a_cluster_asks_the_next_replica(start_daemon: Callable[..., Daemon]) -> None:
    nodes = [start_daemon(), start_daemon()]
    # replicas=2: a copy of every key on each node.
    url = "cluster://" + ",".join(f"127.0.0.1:{d.port}" for d in nodes) + "?replicas=2"
    keys = _keys()
    with Client.connect(url) as client:
        expected = _fill(client, keys)
        assert client.exists_many(keys) == expected
        # Gone from the first node, every key is still on its replica.
        with Client.connect(nodes[0].url()) as first:
            for key, there in zip(keys, expected, strict=True):
                if there:
                    assert first.delete(key)
            assert not any(first.exists_many(keys))
        assert client.exists_many(keys) == expected
    assert _async_answer(url, keys) == expected
    for node in nodes:
        node.stop()
    with Client.connect(url + "&timeout=1") as client:  # nobody answers: all False
        assert client.exists_many(keys[:4]) == [False] * 4


def test_an_unreachable_store_answers_all_false_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"kv://127.0.0.1:{free_port()}?timeout=2&retries=0"
    keys = _keys(3)
    with caplog.at_level(logging.WARNING, logger="kvoffload.client_sdk.request_layer"):
        with Client.connect(url) as client:
            assert client.exists_many(keys) == [False, False, False]
        assert _async_answer(url, keys) == [False, False, False]
    assert caplog.text.count("exists_many: store unreachable") == 2


class _CountingSocket:
    """The client's real socket, its sendmsg calls counted (a socket's methods cannot be
    replaced on the object itself)."""

    def __init__(self, sock: object, counts: list[int]) -> None:
        self._sock, self._counts = sock, counts

    def sendmsg(self, buffers: object) -> int:
        self._counts.append(1)
        return self._sock.sendmsg(buffers)  # type: ignore[attr-defined, no-any-return]


def test_exists_many_over_kv_is_one_write_a_step(
    start_daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pipelined, not one round trip per key: each step of EXISTS_RUN Exists requests leaves
    # in one sendmsg, before any answer is read (N keys: 3 steps, 3 writes, not N).
    daemon = start_daemon()
    keys = _keys()
    writes: list[int] = []
    real = sync.send_all

    def counted(sock: object, parts: object) -> None:
        real(_CountingSocket(sock, writes), parts)  # type: ignore[arg-type]

    with Client.connect(daemon.url()) as client:
        expected = _fill(client, keys)
        assert client.exists(keys[0]) == expected[0]  # connected before counting
        monkeypatch.setattr(sync, "send_all", counted)
        assert client.exists_many(keys) == expected
    assert len(writes) == -(-N // EXISTS_RUN)


def test_concurrent_async_calls_past_the_pending_limit_wait_their_turn(
    start_daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A connection holds at most max_pending outstanding requests (the codec refuses more).
    # With a limit far below one step (EXISTS_RUN) and several calls at once, each step waits
    # for room instead of registering requests it never sends (they stayed outstanding
    # forever) and raising a raw LocalProtocolError.
    monkeypatch.setattr(session, "_LIMITS", dataclasses.replace(session._LIMITS, max_pending=8))
    daemon = start_daemon()
    keys = _keys()
    with Client.connect(daemon.url()) as client:
        expected = _fill(client, keys)

    async def main() -> tuple[list[list[bool]], list[aio._AsyncConnection]]:
        async with AsyncClient.connect(daemon.url()) as client:
            answers = await asyncio.gather(*(client.exists_many(keys) for _ in range(6)))
            conns = [o for o in gc.get_objects() if isinstance(o, aio._AsyncConnection)]
            leaked = [c for c in conns if c.session.calls or c.session.conn.pending]
            assert not leaked, [len(c.session.calls) for c in leaked]
            assert any(c.session.conn.limits.max_pending == 8 for c in conns)
            return list(answers), conns

    answers, _ = asyncio.run(main())
    assert answers == [expected] * 6


def test_a_malformed_key_in_the_middle_of_a_step_leaves_nothing_outstanding(
    start_daemon: Callable[..., Daemon],
) -> None:
    # Below the client's key check (a transport used directly), the codec refuses a malformed
    # key while a step's requests are being started. Over asyncio the ones started before it
    # were registered but never sent, and stayed outstanding on the shared connection (50
    # calls here); now they go out and their answers are taken in. The blocking driver closes
    # a connection that has calls outstanding instead of pooling it (checked here too).
    daemon = start_daemon()
    keys = _keys()
    with Client.connect(daemon.url()) as client:
        expected = _fill(client, keys)
    bad = [*keys[:50], b"", *keys[50:]]

    def outstanding(kind: type) -> list[int]:
        conns = [o for o in gc.get_objects() if isinstance(o, kind)]
        assert conns
        return [len(c.session.calls) + c.session.conn.pending for c in conns]

    transport = open_transport(parse_url(daemon.url()))
    try:
        with pytest.raises(LocalProtocolError):
            transport.exists_many(bad)
        assert transport.exists_many(keys) == expected
        assert not any(outstanding(sync._SyncConnection))
    finally:
        transport.close()

    async def main() -> None:
        threaded = open_async_transport(parse_url(daemon.url()))
        try:
            with pytest.raises(LocalProtocolError):
                await threaded.exists_many(bad)
            assert await threaded.exists_many(keys) == expected
            assert not any(outstanding(aio._AsyncConnection))
        finally:
            await threaded.close()

    asyncio.run(main())
