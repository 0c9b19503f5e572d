"""The daemon agent's prepared descriptor lists (issue 29; docs/guides/nixl.md, "Prepared
descriptor lists"): a transfer of one block reuses the lists prepared for its slot and its
buffer, and no list outlives the registration it was prepared from. Real NIXL agents, the
daemon's and a client's, in this process over loopback TCP; a real engine's arena."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvoffload.client_sdk.transports.native.nixl_memory import NixlMemory
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.nvmeof_target.native import agent as agent_module
from kvoffload.nvmeof_target.native.agent import NixlAgent, NixlPeer, address_of

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None and not os.environ.get("KVOFFLOAD_REQUIRE_NIXL"),
    reason="nixl not installed (CI sets KVOFFLOAD_REQUIRE_NIXL=1)",
)

SIZE = 64 << 10


class _Pair:
    """The daemon's agent with an engine's arena registered, and one client agent loaded."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.agent = NixlAgent(engine, "UCX")
        asyncio.run(self.agent.ready())
        self.client = NixlMemory()
        self.name = self.client.name
        self.agent.names.add(self.name)
        self.agent.load(self.client.metadata(), self.name)
        self.peer = NixlPeer(self.name)
        self.ours, self.theirs = socket.socketpair()

    def register(self, buffer: np.ndarray) -> tuple[int, int]:
        region, partial = self.client.register(memoryview(buffer))
        self.agent.load(partial, self.name)
        self.peer.change(region, ())
        return region

    def revoke(self, region: tuple[int, int]) -> None:
        self.peer.change((), region)
        self.agent.revoke(self.name, region)
        self.client.deregister(region)

    def write(self, key: bytes, addr: int) -> None:
        """What a NixlGet of one block does: check, then WRITE its payload to `addr`."""
        view = self.engine.get(key)
        assert view is not None
        try:
            n = len(view)
            self.peer.check(addr, n)
            asyncio.run(self._move([(address_of(view.data), n)], [(addr, n)], view))
        finally:
            view.release()

    async def _move(
        self, local: list[tuple[int, int]], remote: list[tuple[int, int]], held: object
    ) -> None:
        deadline = time.monotonic() + 20
        move = asyncio.ensure_future(
            self.agent.move("WRITE", local, remote, self.name, deadline, held, self.ours)
        )
        while not move.done():  # over TCP the client's progress moves the bytes
            self.client.progress()
            await asyncio.sleep(0.0005)
        await move

    def close(self) -> None:
        self.agent.forget(self.name)
        self.client.close()
        self.ours.close()
        self.theirs.close()


@pytest.fixture
def pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Pair]:
    monkeypatch.setenv("UCX_TLS", "tcp")  # the daemon's agent rewrites it: restored after
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    config = EngineConfig(
        DramConfig(capacity_bytes=8 << 20, max_value_bytes=1 << 20, prefault=False),
        SsdConfig(capacity_bytes=0),
        data_dir=str(tmp_path),
    )
    with Engine(config) as engine:
        pair = _Pair(engine)
        try:
            yield pair
        finally:
            pair.close()


def _put(engine: Engine, key: bytes, fill: int) -> np.ndarray:
    value = np.full(SIZE, fill, np.uint8)
    engine.put(key, value)
    return value


def test_a_block_moves_through_lists_prepared_once(pair: _Pair) -> None:
    buffer = np.zeros(SIZE, np.uint8)
    addr, _ = pair.register(buffer)
    for i in range(3):
        value = _put(pair.engine, b"%016d" % i, i + 1)
        pair.write(b"%016d" % i, addr)
        assert np.array_equal(buffer, value)
    assert pair.agent.prepared(pair.name) == [(addr, SIZE)]  # one list for the buffer


def test_a_revoke_drops_the_lists_prepared_in_the_region(pair: _Pair) -> None:
    buffer, other = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    region = pair.register(buffer)
    kept = pair.register(other)
    _put(pair.engine, b"k" * 16, 7)
    pair.write(b"k" * 16, region[0])
    pair.write(b"k" * 16, kept[0])
    assert sorted(pair.agent.prepared(pair.name)) == sorted([(region[0], SIZE), (kept[0], SIZE)])
    pair.revoke(region)
    assert pair.agent.prepared(pair.name) == [(kept[0], SIZE)]


def test_a_buffer_registered_again_at_the_same_address_gets_fresh_lists(pair: _Pair) -> None:
    buffer = np.zeros(SIZE, np.uint8)
    region = pair.register(buffer)
    _put(pair.engine, b"a" * 16, 3)
    pair.write(b"a" * 16, region[0])
    pair.client.deregister(region)  # a client that re-registers without revoking first
    again = pair.register(buffer)
    assert again == region
    # The new metadata dropped every list prepared from the old registration.
    assert pair.agent.prepared(pair.name) == []
    buffer[:] = 0
    value = _put(pair.engine, b"b" * 16, 9)
    pair.write(b"b" * 16, region[0])
    assert np.array_equal(buffer, value)
    assert pair.agent.prepared(pair.name) == [(region[0], SIZE)]


def test_forgetting_the_agent_drops_its_lists(pair: _Pair) -> None:
    buffer = np.zeros(SIZE, np.uint8)
    addr, _ = pair.register(buffer)
    _put(pair.engine, b"f" * 16, 5)
    pair.write(b"f" * 16, addr)
    pair.agent.forget(pair.name)
    assert pair.agent.prepared(pair.name) == []


def test_the_lists_are_bounded(pair: _Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "_MAX_REMOTE_LISTS", 2)
    buffers = [np.zeros(SIZE, np.uint8) for _ in range(3)]
    addrs = [pair.register(b)[0] for b in buffers]
    value = _put(pair.engine, b"l" * 16, 6)
    for addr in (*addrs, addrs[0]):  # the first one again, after it fell out
        pair.write(b"l" * 16, addr)
    assert pair.agent.prepared(pair.name) == [(addrs[2], SIZE), (addrs[0], SIZE)]
    assert all(np.array_equal(b, value) for b in buffers)
