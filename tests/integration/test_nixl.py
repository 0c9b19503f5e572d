"""The NIXL data path (`kv://...?data=nixl`, issue 16) with real NIXL agents: the daemon's in a
real daemon subprocess, the client's in this process, over loopback UCX with shared memory
and TCP (`UCX_TLS=sm,tcp`) and TCP alone.

NIXL is optional: without it these tests skip, unless KVOFFLOAD_REQUIRE_NIXL=1 (CI) makes a
missing NIXL a failure.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import select
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvoffload.bench.micro.net_nixl import nixl_rows
from kvoffload.client_sdk import AsyncClient, Client
from kvoffload.client_sdk.transports.native import nixl as nixl_transport
from kvoffload.client_sdk.transports.native.nixl_memory import MAX_REGIONS, NixlMemory
from kvoffload.client_sdk.transports.native.options import NativeOptions
from kvoffload.client_sdk.url import parse_url
from kvoffload.errors import ConfigError, DeadlineExceededError, InvalidArgumentError
from kvoffload.wire.block import HEADER_BYTES
from kvoffload.wire.native.connection import (
    NIXL_DEADLINE_VERSION,
    NIXL_VERSION,
    ConnectionClosed,
    ErrorReply,
    Event,
    Get,
    GetResult,
    Hello,
    NativeConnection,
    NixlGet,
    NixlGetResult,
    NixlMemoryDone,
    Role,
)
from kvoffload.wire.native.connection import (
    NixlMemory as NixlMemoryEvent,
)
from kvoffload.wire.shards import shard_of
from kvoffload.wire.status import Status
from tests.conftest import Daemon
from tests.integration.test_client_bad_answers import peer
from tests.integration.test_daemon import _self_signed

_HAVE_NIXL = importlib.util.find_spec("nixl") is not None
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not _HAVE_NIXL and not os.environ.get("KVOFFLOAD_REQUIRE_NIXL"),
        reason="nixl not installed (CI sets KVOFFLOAD_REQUIRE_NIXL=1)",
    ),
]

Start = Callable[..., Daemon]
MiB = 1 << 20


@pytest.fixture(params=["sm,tcp", "tcp"])
def ucx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """UCX settings for loopback, in this process (read when an agent is made) and for the
    daemon's environment."""
    env = {"UCX_TLS": request.param, "UCX_NET_DEVICES": "lo"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def _values(n: int, size: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(n)]
    return keys, [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def test_put_and_get_move_bit_exact(start_daemon: Start, ucx: dict[str, str]) -> None:
    daemon = start_daemon(env=ucx)
    keys, values = _values(6, 2 * MiB + 123, seed=1)
    with Client.connect(daemon.url(data="nixl")) as client:
        for key, value in zip(keys, values, strict=True):
            client.put(key, value)
        buffer = np.zeros(3 * MiB, np.uint8)
        for key, value in zip(keys, values, strict=True):
            assert client.get_into(key, buffer) == value.size
            assert np.array_equal(buffer[: value.size], value)
            assert not buffer[value.size :].any()  # nothing past the block
        buffers = [np.zeros(value.size, np.uint8) for value in values]
        missing = b"\x07" * 16
        got = client.get_many_into([*keys, missing], [*buffers, np.zeros(8, np.uint8)])
        assert got == [v.size for v in values] + [None]
        assert all(np.array_equal(b, v) for b, v in zip(buffers, values, strict=True))
        client.put_many([(keys[0], values[1]), (keys[1], values[0])])
        assert client.get_into(keys[0], buffer) == values[1].size
        assert np.array_equal(buffer[: values[1].size], values[1])
        assert client.get_into(missing, buffer) is None
        assert bytes(client.get(keys[2]) or b"") == values[2].tobytes()  # the socket path
        stats = client.stats()
    assert stats.corrupt_blocks == 0  # every get was verified in the caller's buffer


def test_batches_naming_more_buffers_than_the_registration_cache(
    start_daemon: Start, ucx: dict[str, str]
) -> None:
    daemon = start_daemon(env=ucx)
    count = MAX_REGIONS + 6  # every buffer of a batch stays registered until it is answered
    keys, values = _values(count, 4096, seed=7)
    with Client.connect(daemon.url(data="nixl")) as client:
        client.put_many(list(zip(keys, values, strict=True)))
        buffers = [np.zeros(4096, np.uint8) for _ in keys]
        assert client.get_many_into(keys, buffers) == [4096] * count
        assert all(np.array_equal(b, v) for b, v in zip(buffers, values, strict=True))
        # A miss leaves its buffer as it was; a hit writes nothing past its block.
        seven = np.full(8192, 7, np.uint8)
        assert client.get_into(b"\x09" * 16, seven) is None
        assert (seven == 7).all()
        assert client.get_into(keys[0], seven) == 4096
        assert np.array_equal(seven[:4096], values[0]) and (seven[4096:] == 7).all()


def test_the_registration_cache_keeps_to_its_byte_bound(
    start_daemon: Start, ucx: dict[str, str]
) -> None:
    daemon = start_daemon(env=ucx)
    keys, values = _values(4, MiB, seed=8)
    with Client.connect(daemon.url()) as plain:
        plain.put_many(list(zip(keys, values, strict=True)))
    url = daemon.url(data="nixl", nixl_cache_bytes=str(3 * MiB), pool="1")
    transport = nixl_transport.open_nixl(NativeOptions.from_url(parse_url(url)))

    def get(key: bytes, buffer: np.ndarray) -> None:
        assert transport.get_into(key, memoryview(buffer)) is not None

    def held() -> set[int]:
        lane = transport._take()
        assert lane is not None
        try:
            assert lane.memory.nbytes <= 3 * MiB
            return {start for start, _ in lane.memory.regions}
        finally:
            transport._give(lane, True)

    try:
        buffers = [np.zeros(MiB, np.uint8) for _ in keys]
        for key, buffer, value in zip(keys, buffers, values, strict=True):
            get(key, buffer)
            assert np.array_equal(buffer, value)
        assert held() == {b.ctypes.data for b in buffers[1:]}  # buffer 0 fell out first
        # Touched again, buffer 1 is the most recently used: the next new one evicts
        # buffer 2, the least recently used now.
        get(keys[1], buffers[1])
        extra = np.zeros(MiB, np.uint8)
        get(keys[2], extra)
        assert np.array_equal(extra, values[2])
        assert held() == {b.ctypes.data for b in (buffers[1], buffers[3], extra)}
        # A batch naming more bytes than the bound keeps them all registered until it is
        # answered (checked in `reach`), and the cache is back under the bound after it.
        for b in buffers:
            b[:] = 0
        got = transport.get_many_into(keys, [memoryview(b) for b in buffers])
        assert all(g is not None for g in got)
        assert all(np.array_equal(b, v) for b, v in zip(buffers, values, strict=True))
        get(keys[0], buffers[0])
        assert len(held()) == 3
    finally:
        transport.close()


def test_a_revoke_reaches_lanes_in_use(start_daemon: Start, ucx: dict[str, str]) -> None:
    daemon = start_daemon(env=ucx)
    transport = nixl_transport.open_nixl(NativeOptions.from_url(parse_url(daemon.url(data="nixl"))))
    try:
        buffer = memoryview(np.zeros(4096, np.uint8))
        assert transport.get_into(b"\x01" * 16, buffer) is None  # registered on a lane
        lane = transport._take()  # in use, as by another thread's request
        assert lane is not None and len(lane.memory.regions) == 1
        assert transport.revoke(buffer) == 0  # no idle lane had it
        assert len(lane.memory.regions) == 1  # the request in flight may name it: kept
        transport._give(lane, True)
        assert lane.memory.regions == []  # revoked (daemon first) once given back
    finally:
        transport.close()


def test_a_revoke_reaches_lanes_another_revoke_holds(
    start_daemon: Start, ucx: dict[str, str]
) -> None:
    # A second revoke arriving while the first one works on the idle lanes (here: from inside
    # the first's round trip) must still reach them, not find them neither idle nor busy.
    daemon = start_daemon(env=ucx)
    transport = nixl_transport.open_nixl(NativeOptions.from_url(parse_url(daemon.url(data="nixl"))))
    try:
        first, second = (memoryview(np.zeros(4096, np.uint8)) for _ in range(2))
        assert transport.get_into(b"\x01" * 16, first) is None
        assert transport.get_into(b"\x02" * 16, second) is None
        lane = transport._take()
        assert lane is not None and len(lane.memory.regions) == 2
        transport._give(lane, True)
        real, nested = lane.revoke, []

        def revoke(buffer: memoryview) -> int:
            if not nested:
                nested.append(transport.revoke(second))  # meanwhile, from another caller
            return real(buffer)

        lane.revoke = revoke  # type: ignore[method-assign]
        assert transport.revoke(first) == 1
        assert nested == [0]  # it found no idle lane: the lane was being revoked on ...
        assert lane.memory.regions == []  # ... and its revoke was done when it came back
    finally:
        transport.close()


def test_a_plain_kv_client_sees_what_nixl_stored(start_daemon: Start, ucx: dict[str, str]) -> None:
    daemon = start_daemon(env=ucx)
    keys, values = _values(3, 300_000, seed=2)
    with Client.connect(daemon.url(data="nixl")) as nixl, Client.connect(daemon.url()) as plain:
        nixl.put_many(list(zip(keys, values, strict=True)))
        for key, value in zip(keys, values, strict=True):
            assert bytes(plain.get(key) or b"") == value.tobytes()
        plain.put(keys[0], values[2])
        out = np.zeros(300_000, np.uint8)
        assert nixl.get_into(keys[0], out) == 300_000 and np.array_equal(out, values[2])


def test_a_buffer_too_small_writes_nothing(start_daemon: Start, ucx: dict[str, str]) -> None:
    daemon = start_daemon(env=ucx)
    with Client.connect(daemon.url(data="nixl")) as client:
        client.put(b"k" * 16, np.ones(MiB, np.uint8))
        small = np.zeros(MiB - 1, np.uint8)
        with pytest.raises(InvalidArgumentError, match="too small"):
            client.get_into(b"k" * 16, small)
        assert not small.any()


def test_async_client_and_get_many(start_daemon: Start, ucx: dict[str, str]) -> None:
    daemon = start_daemon(env=ucx)
    keys, values = _values(4, 100_000, seed=3)

    async def run() -> None:
        async with AsyncClient.connect(daemon.url(data="nixl")) as client:
            await client.put_many(list(zip(keys, values, strict=True)))
            buffers = [np.zeros(100_000, np.uint8) for _ in keys]
            assert await client.get_many_into(keys, buffers) == [100_000] * 4
            assert all(np.array_equal(b, v) for b, v in zip(buffers, values, strict=True))
            one = np.zeros(100_000, np.uint8)
            assert await client.get_into(keys[3], one) == 100_000
            assert np.array_equal(one, values[3])

    asyncio.run(run())


def test_two_workers_one_agent_each(start_daemon: Start, ucx: dict[str, str]) -> None:
    daemon = start_daemon("--workers", "2", env=ucx)
    keys, values = _values(24, 70_000, seed=4)
    assert {shard_of(k, 2) for k in keys} == {0, 1}
    with Client.connect(daemon.url(data="nixl")) as client:
        client.put_many(list(zip(keys, values, strict=True)))
        buffers = [np.zeros(70_000, np.uint8) for _ in keys]
        assert client.get_many_into(keys, buffers) == [70_000] * len(keys)
        assert all(np.array_equal(b, v) for b, v in zip(buffers, values, strict=True))


def test_through_the_cluster_layer(start_daemon: Start, ucx: dict[str, str]) -> None:
    nodes = [start_daemon(env=ucx), start_daemon(env=ucx)]
    hosts = ",".join(f"127.0.0.1:{d.port}" for d in nodes)
    keys, values = _values(8, 50_000, seed=5)
    with Client.connect(f"cluster://{hosts}?data=nixl&timeout=60") as client:
        client.put_many(list(zip(keys, values, strict=True)))
        buffer = np.zeros(50_000, np.uint8)
        for key, value in zip(keys, values, strict=True):
            assert client.get_into(key, buffer) == 50_000 and np.array_equal(buffer, value)


# ---------------------------------------------------------------------------- refusals


def test_a_protocol_2_daemon_gets_kv_payloads() -> None:
    """A daemon older than the NIXL path refuses the version 3 Hello: the client moves the
    payload through the socket instead (and never offers its agent)."""
    asked: list[type[Event]] = []

    def answer(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
        asked.append(type(event))
        return b"".join(conn.send_parts(GetResult(event.request_id, None))), False

    with peer(answer, speaks=(1, 2)) as port:
        url = f"kv://127.0.0.1:{port}?data=nixl&retries=0&timeout=10"
        with Client.connect(url) as client:
            assert client.get_into(os.urandom(16), np.zeros(100, np.uint8)) is None
            assert client.get_into(os.urandom(16), np.zeros(100, np.uint8)) is None
    assert asked == [Get, Get]


def test_a_tls_daemon_refuses_nixl_unless_allowed(start_daemon: Start, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    params = {"tls": "1", "ca": str(cert), "server_name": "localhost", "data": "nixl"}
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    refusing = start_daemon(*tls, env=env)
    with Client.connect(refusing.url(**params)) as client:
        with pytest.raises(ConfigError, match="nixl_over_tls"):
            client.put(b"t" * 16, np.ones(1000, np.uint8))
        assert refusing.proc.poll() is None
    allowing = start_daemon(*tls, env={**env, "KVOFFLOAD_NATIVE__NIXL_OVER_TLS": "true"})
    with Client.connect(allowing.url(**params)) as client:
        client.put(b"t" * 16, np.ones(1000, np.uint8))
        out = np.zeros(1000, np.uint8)
        assert client.get_into(b"t" * 16, out) == 1000 and out.all()


def test_a_backend_that_cannot_be_created(start_daemon: Start, ucx: dict[str, str]) -> None:
    daemon = start_daemon(env={**ucx, "KVOFFLOAD_NATIVE__NIXL_BACKEND": "NOSUCH"})
    with (
        Client.connect(daemon.url(data="nixl")) as client,
        pytest.raises(ConfigError, match="NOSUCH"),
    ):
        client.put(b"b" * 16, np.ones(1000, np.uint8))
    with Client.connect(daemon.url()) as plain:  # the daemon lives and serves kv://
        plain.put(b"b" * 16, b"still here")
        assert plain.get(b"b" * 16) == b"still here"


# ---------------------------------------------------------------------------- raw protocol 3


class _Raw:
    """A protocol 3 client by hand, with a real NIXL agent: to send what the SDK never does."""

    def __init__(self, port: int, version: int | None = None) -> None:
        self.memory = NixlMemory()  # first: making it may take longer than the Hello may
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.conn = NativeConnection(Role.CLIENT)
        self.ids = iter(range(1, 1 << 20))
        hello = Hello(next(self.ids)) if version is None else Hello(next(self.ids), version)
        assert isinstance(self.ask(hello), Event)

    def send(self, event: Event) -> None:
        self.sock.sendall(self.conn.send(event))

    def answer(self) -> Event | ConnectionClosed:
        """The next answer, driving our agent's progress while none is there (a transfer over
        TCP needs it), for at most 20 s."""
        for _ in range(20_000):
            event = self.conn.next_event()
            if isinstance(event, (Event, ConnectionClosed)):
                return event
            if select.select([self.sock], [], [], 0.001)[0]:
                self.conn.receive_data(self.sock.recv(1 << 16))
            else:
                self.memory.progress()
        raise AssertionError("no answer")

    def ask(self, event: Event) -> Event | ConnectionClosed:
        self.send(event)
        return self.answer()

    def register(self, buffer: np.ndarray) -> tuple[int, int]:
        region, partial = self.memory.register(memoryview(buffer))
        first = self.memory.metadata() if len(self.memory.regions) == 1 else partial
        answer = self.ask(NixlMemoryEvent(next(self.ids), first, region))
        assert isinstance(answer, NixlMemoryDone), answer
        self.prove()
        return region

    def prove(self) -> None:
        """Echo the nonce the daemon sent our agent (as the SDK does after each metadata)."""
        for _ in range(20_000):
            self.memory.progress()
            nonce = self.memory.take_proof()
            if nonce is not None:
                answer = self.ask(NixlMemoryEvent(next(self.ids), echo=nonce))
                assert isinstance(answer, NixlMemoryDone), answer
                return
            time.sleep(0.001)
        raise AssertionError("no proof notification from the daemon")

    def close(self) -> None:
        self.sock.close()
        self.memory.close()


@pytest.fixture
def raw(start_daemon: Start, ucx: dict[str, str]) -> Iterator[tuple[Daemon, _Raw]]:
    daemon = start_daemon("--dram", "128MiB", env=ucx)
    client = _Raw(daemon.port)
    yield daemon, client
    client.close()


def _intact(daemon: Daemon, key: bytes, value: np.ndarray) -> None:
    """The daemon lives and the block reads back whole, over both data paths."""
    assert daemon.proc.poll() is None
    for url in (daemon.url(), daemon.url(data="nixl")):
        with Client.connect(url) as client:
            out = np.zeros(value.size, np.uint8)
            assert client.get_into(key, out) == value.size and np.array_equal(out, value)


def _refused(raw: _Raw, event: Event, match: str) -> None:
    answer = raw.ask(event)
    assert isinstance(answer, ErrorReply) and answer.status == Status.INVALID_ARGUMENT
    assert match in answer.message
    assert isinstance(raw.answer(), ConnectionClosed)  # the connection alone is dropped


def test_a_descriptor_outside_registered_memory(raw: tuple[Daemon, _Raw]) -> None:
    daemon, client = raw
    key, value = b"d" * 16, np.arange(MiB, dtype=np.uint32).view(np.uint8)[:MiB]
    with Client.connect(daemon.url()) as plain:
        plain.put(key, value)
    buffer = np.zeros(MiB, np.uint8)
    addr, size = client.register(buffer)
    # One byte past the region: refused before anything moves.
    event = NixlGet(next(client.ids), (key,), (addr + 1,), (size,))
    _refused(client, event, "outside this connection's registered memory")
    assert not buffer.any()
    _intact(daemon, key, value)


def test_a_revoked_registration(raw: tuple[Daemon, _Raw]) -> None:
    daemon, client = raw
    key, value = b"r" * 16, np.full(MiB, 9, np.uint8)
    with Client.connect(daemon.url()) as plain:
        plain.put(key, value)
    buffer, other = np.zeros(MiB, np.uint8), np.zeros(4096, np.uint8)
    addr, size = client.register(buffer)
    client.register(other)
    revoked = client.ask(NixlMemoryEvent(next(client.ids), revoke=(addr, size)))
    assert isinstance(revoked, NixlMemoryDone)
    _refused(client, NixlGet(next(client.ids), (key,), (addr,), (size,)), "outside")
    assert not buffer.any()
    _intact(daemon, key, value)


def test_a_revoked_registration_is_not_reached_through_its_prepared_lists(
    raw: tuple[Daemon, _Raw],
) -> None:
    """A get into the buffer first, so that the daemon has lists prepared for it (issue 29):
    after the revoke the same descriptor is refused all the same."""
    daemon, client = raw
    key, value = b"p" * 16, np.full(MiB, 4, np.uint8)
    with Client.connect(daemon.url()) as plain:
        plain.put(key, value)
    buffer = np.zeros(MiB, np.uint8)
    addr, size = client.register(buffer)
    got = client.ask(NixlGet(next(client.ids), (key,), (addr,), (size,)))
    assert isinstance(got, NixlGetResult) and got.lengths == (HEADER_BYTES + MiB,)
    assert np.array_equal(buffer, value)
    buffer[:] = 0
    revoked = client.ask(NixlMemoryEvent(next(client.ids), revoke=(addr, size)))
    assert isinstance(revoked, NixlMemoryDone)
    _refused(client, NixlGet(next(client.ids), (key,), (addr,), (size,)), "outside")
    assert not buffer.any()
    _intact(daemon, key, value)


def test_a_buffer_registered_again_gets_its_blocks(
    start_daemon: Start, ucx: dict[str, str]
) -> None:
    """Revoked and registered again at the same address (new registration, new metadata): the
    daemon's lists prepared for it before are not used (issue 29)."""
    daemon = start_daemon(env=ucx)
    keys, values = _values(3, MiB, seed=29)
    url = daemon.url(data="nixl", pool="1")
    transport = nixl_transport.open_nixl(NativeOptions.from_url(parse_url(url)))
    with Client.connect(daemon.url()) as plain:
        plain.put_many(list(zip(keys, values, strict=True)))
    try:
        out = np.zeros(MiB, np.uint8)
        for key, value in zip(keys, values, strict=True):
            out[:] = 0
            assert transport.get_into(key, memoryview(out)) is not None
            assert np.array_equal(out, value)
            assert transport.revoke(memoryview(out)) == 1  # the next get registers it anew
    finally:
        transport.close()
    _intact(daemon, keys[0], values[0])


def test_another_connections_agent_is_refused(raw: tuple[Daemon, _Raw]) -> None:
    daemon, client = raw
    client.register(np.zeros(4096, np.uint8))
    thief = _Raw(daemon.port)
    try:  # the metadata names the first connection's agent: never shared
        refusal = thief.ask(NixlMemoryEvent(next(thief.ids), client.memory.metadata()))
        assert isinstance(refusal, ErrorReply) and refusal.status == Status.AUTH
        assert isinstance(thief.answer(), ConnectionClosed)
    finally:
        thief.close()
    assert isinstance(client.ask(NixlMemoryEvent(next(client.ids))), NixlMemoryDone)


def test_another_connections_agent_is_refused_before_it_is_loaded(
    raw: tuple[Daemon, _Raw],
) -> None:
    daemon, victim = raw
    key, value = b"o" * 16, np.full(4096, 5, np.uint8)
    with Client.connect(daemon.url()) as plain:
        plain.put(key, value)
    buffer = np.zeros(4096, np.uint8)
    addr, size = victim.register(buffer)
    name = victim.memory.name.encode()
    # Metadata that names the victim's agent but that NIXL could not even load: refused for
    # whose it is (AUTH), not for what NIXL makes of it, so nothing was loaded first.
    forged = b"nixlSerDes|Agent" + len(name).to_bytes(8, "little") + name + b"|junk"
    thief = _Raw(daemon.port)
    try:
        refusal = thief.ask(NixlMemoryEvent(next(thief.ids), forged))
        assert isinstance(refusal, ErrorReply) and refusal.status == Status.AUTH, refusal
    finally:
        thief.close()
    # A connection with its own agent that then names the victim's: refused the same way.
    thief = _Raw(daemon.port)
    try:
        thief.register(np.zeros(4096, np.uint8))
        _, partial = victim.memory.register(memoryview(np.zeros(8192, np.uint8)))
        refusal = thief.ask(NixlMemoryEvent(next(thief.ids), partial))
        assert isinstance(refusal, ErrorReply) and refusal.status == Status.AUTH, refusal
        assert isinstance(thief.answer(), ConnectionClosed)
    finally:
        thief.close()
    got = victim.ask(NixlGet(next(victim.ids), (key,), (addr,), (size,)))
    assert isinstance(got, NixlGetResult) and got.lengths == (4096 + 96,), got
    assert np.array_equal(buffer, value)  # the victim's agent and memory are untouched


def test_no_transfer_once_the_clients_budget_is_spent(raw: tuple[Daemon, _Raw]) -> None:
    daemon, client = raw
    key, value = b"b" * 16, np.full(4096, 3, np.uint8)  # small: moves without our progress
    with Client.connect(daemon.url()) as plain:
        plain.put(key, value)
    buffer = np.zeros(4096, np.uint8)
    addr, size = client.register(buffer)
    late = client.ask(NixlGet(next(client.ids), (key,), (addr,), (size,), budget_ms=0))
    assert isinstance(late, ErrorReply) and late.status == Status.DEADLINE, late
    assert not buffer.any()  # nothing posted
    # Nothing moved, so the connection stays; with time left the same get lands.
    got = client.ask(NixlGet(next(client.ids), (key,), (addr,), (size,), budget_ms=60_000))
    assert isinstance(got, NixlGetResult) and np.array_equal(buffer, value)
    _intact(daemon, key, value)


@pytest.mark.parametrize("version", [NIXL_VERSION, NIXL_DEADLINE_VERSION])
def test_a_client_before_protocol_5_is_refused_the_data_path(
    raw: tuple[Daemon, _Raw], version: int
) -> None:
    # It cannot prove that the worker its metadata declares is its own (NixlMemory's echo).
    daemon, _ = raw
    old = _Raw(daemon.port, version=version)
    try:
        buffer = np.zeros(4096, np.uint8)
        region, _ = old.memory.register(memoryview(buffer))
        answer = old.ask(NixlMemoryEvent(next(old.ids), old.memory.metadata(), region))
        assert isinstance(answer, ErrorReply) and "needs protocol 5" in answer.message
    finally:
        old.close()
    assert daemon.proc.poll() is None


def test_a_protocol_3_daemon_gets_no_budget(ucx: dict[str, str]) -> None:
    """A version 4 client lowers its NIXL lanes to version 3 for an older daemon and sends
    it only the fields it knows."""
    asked: list[Event] = []

    def answer(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
        asked.append(event)
        reply: Event = (
            NixlGetResult(event.request_id, (None,), ())
            if isinstance(event, NixlGet)
            else NixlMemoryDone(event.request_id)
        )
        return b"".join(conn.send_parts(reply)), False

    with peer(answer, speaks=(1, 2, 3)) as port:
        url = f"kv://127.0.0.1:{port}?data=nixl&retries=0&timeout=10"
        with Client.connect(url) as client:
            assert client.get_into(os.urandom(16), np.zeros(100, np.uint8)) is None
    gets = [e for e in asked if isinstance(e, NixlGet)]
    assert len(gets) == 1 and gets[0].budget_ms is None


def test_a_get_past_its_deadline_never_hands_back_a_buffer_still_reachable(
    start_daemon: Start, ucx: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = start_daemon(env=ucx)
    key, value = b"t" * 16, np.full(MiB, 6, np.uint8)
    buffer = np.zeros(MiB, np.uint8)
    nixl_transport.release_quarantined()  # what earlier tests left, if their daemons went
    before = len(nixl_transport.quarantined)
    monkeypatch.setattr(nixl_transport, "_MAX_QUARANTINED", before + 1)
    with Client.connect(daemon.url(data="nixl", timeout="1", retries="0")) as client:
        client.put(key, value)
        assert client.get_into(key, buffer) == MiB  # the lane and its registration exist
        buffer[:] = 0
        doomed = np.zeros(MiB, np.uint8)  # the stalled get's buffer, dropped by its caller
        assert client.get_into(key, doomed) == MiB  # registered before the stall
        doomed[:] = 0
        kept = weakref.ref(doomed)
        # The daemon stalls past the deadline and the settling time: the client cannot know
        # whether a WRITE is still coming, so it says so and keeps the memory registered.
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DeadlineExceededError, match="did not confirm"):
                client.get_into(key, doomed)
            assert len(nixl_transport.quarantined) == before + 1
            assert nixl_transport.release_quarantined() == 0  # no word from the daemon yet
            # The quarantine is full: no new NIXL lane (whose memory it might have to keep
            # too); the call takes kv:// and fails on the stalled daemon all the same.
            with pytest.raises(DeadlineExceededError) as plain:
                client.get_into(key, buffer)
            assert "did not confirm" not in str(plain.value)
            assert len(nixl_transport.quarantined) == before + 1
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        _served(daemon, key, value)  # the stalled request is handled by now
        assert not doomed.any()  # the client had hung up: the daemon posted nothing
        del doomed
        assert kept() is not None  # the quarantine keeps its memory allocated and registered
        # The daemon has answered the request on the lane's half-closed connection (or closed
        # it): its handler is over, so the lane's memory is deregistered and let go.
        assert _released(before) and kept() is None
        # A stall the daemon recovers from within the settling time: it is seen to be done
        # with the request (it refuses it: the client hung up), so nothing is quarantined.
        assert client.get_into(key, buffer) == MiB  # a new lane, registered before the stall
        buffer[:] = 0
        errors: list[BaseException] = []

        def get() -> None:
            try:
                client.get_into(key, buffer)
            except BaseException as exc:
                errors.append(exc)

        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=get)
            thread.start()
            thread.join(2.5)  # past the 1 s deadline, inside the 5 s settling time
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        thread.join()
        assert len(errors) == 1 and isinstance(errors[0], DeadlineExceededError)
        assert "did not confirm" not in str(errors[0])
        assert len(nixl_transport.quarantined) == before
        assert not buffer.any()


def _released(count: int) -> bool:
    """Whether the quarantine is down to `count` lanes, releasing what it can for up to 20 s
    (the daemon answers the stalled request once its loop runs again)."""
    for _ in range(2000):
        nixl_transport.release_quarantined()
        if len(nixl_transport.quarantined) <= count:
            gc.collect()
            return True
        time.sleep(0.01)
    return False


def _served(daemon: Daemon, key: bytes, value: np.ndarray) -> None:
    """Round trips on a new connection: the daemon's loop has handled what was waiting."""
    with Client.connect(daemon.url()) as plain:
        for _ in range(20):
            assert bytes(plain.get(key) or b"") == value.tobytes()


def test_other_connections_are_served_while_the_agent_is_made(
    start_daemon: Start, ucx: dict[str, str]
) -> None:
    daemon = start_daemon(env=ucx)
    key = b"m" * 16
    window: list[float] = []
    done: list[float] = []  # when each plain get that started inside the window finished
    with Client.connect(daemon.url()) as plain:
        plain.put(key, b"x" * 4096)
        client = _Raw(daemon.port)  # our own agent is made before the daemon's
        stop = threading.Event()

        def gets() -> None:
            while not stop.is_set():
                began = time.monotonic()
                assert plain.get(key) == b"x" * 4096
                if window and began > window[0]:
                    done.append(time.monotonic())

        thread = threading.Thread(target=gets)
        thread.start()
        try:
            window.append(time.monotonic())
            client.register(np.zeros(4096, np.uint8))  # the daemon makes its agent now
            window.append(time.monotonic())
        finally:
            stop.set()
            thread.join()
            client.close()
    # The agent takes 0.3-6 s to make; gets take well under a millisecond. A daemon that
    # made it on its loop answered none meanwhile (at most one slipped in before it began).
    assert sum(1 for t in done if t < window[1]) >= 3


def test_a_client_that_vanishes_mid_transfer(start_daemon: Start) -> None:
    # Over TCP a WRITE needs the client's progress: this one never gives it, and goes.
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    os.environ.update(env)
    try:
        daemon = start_daemon(
            "--dram", "256MiB", env={**env, "KVOFFLOAD_NATIVE__FRAME_TIMEOUT_S": "5"}
        )
        key, value = b"v" * 16, np.random.default_rng(6).integers(0, 256, 16 * MiB - 4096, np.uint8)
        with Client.connect(daemon.url()) as plain:
            plain.put(key, value)
        client = _Raw(daemon.port)
        buffer = np.zeros(value.size, np.uint8)
        addr, size = client.register(buffer)
        client.send(NixlGet(next(client.ids), (key,), (addr,), (size,)))
        client.close()  # no progress, no answer read: gone
        del client
        _intact(daemon, key, value)
    finally:
        for name in env:
            os.environ.pop(name, None)


def test_an_idle_connection_costs_no_cpu(start_daemon: Start, ucx: dict[str, str]) -> None:
    daemon = start_daemon(env=ucx)
    with Client.connect(daemon.url(data="nixl")) as client:
        client.put(b"i" * 16, np.ones(MiB, np.uint8))
        assert client.get_into(b"i" * 16, np.zeros(MiB, np.uint8)) == MiB  # agents are up
        mine, theirs = time.process_time(), _cpu_s(daemon.proc.pid)
        time.sleep(2.0)  # idle: neither side may spin a progress thread meanwhile
        # A spinning thread would burn ~2 s of CPU here; a quiet pair, a few ms.
        assert time.process_time() - mine < 0.5
        assert _cpu_s(daemon.proc.pid) - theirs < 0.5


def test_a_long_transfer_does_not_spin_the_daemon(start_daemon: Start) -> None:
    # Over TCP a WRITE needs the client's progress: this client gives none, so the daemon's
    # transfer stays in progress; waiting for it must not busy-poll its loop.
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    os.environ.update(env)
    try:
        daemon = start_daemon(
            "--dram", "256MiB", env={**env, "KVOFFLOAD_NATIVE__FRAME_TIMEOUT_S": "30"}
        )
        key, value = b"s" * 16, np.ones(16 * MiB - 4096, np.uint8)
        with Client.connect(daemon.url()) as plain:
            plain.put(key, value)
        client = _Raw(daemon.port)
        try:
            buffer = np.zeros(value.size, np.uint8)
            addr, size = client.register(buffer)
            client.send(NixlGet(next(client.ids), (key,), (addr,), (size,)))
            time.sleep(0.5)  # the transfer has been posted
            theirs, wall = _cpu_s(daemon.proc.pid), time.monotonic()
            time.sleep(2.0)
            # A loop polling with sleep(0) burns a whole core (38 % of it measured on a busy
            # host); one that naps up to 2 ms between polls, ~5 %.
            assert _cpu_s(daemon.proc.pid) - theirs < 0.2 * (time.monotonic() - wall)
        finally:
            client.close()
        _intact(daemon, key, value)
    finally:
        for name in env:
            os.environ.pop(name, None)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_bench_rows(ucx: dict[str, str]) -> None:
    # 200 gets: enough CPU for /proc's 10 ms clock ticks to count on both sides (20 did not).
    rows = {row.case: row for row in nixl_rows(rounds=1, working_set=MiB, cpu_requests=200)}
    assert set(rows) == {
        "get_nixl/2MiB",
        "get_nixl/8MiB",
        "put_nixl/2MiB",
        "daemon_cpu_us/get_nixl/2MiB",
    }
    assert rows["get_nixl/8MiB"].ref == "memcpy_crc"
    for row in rows.values():
        assert row.value > 0 and row.ref_value and row.ratio, row
