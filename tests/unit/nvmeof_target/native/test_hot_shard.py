"""`HotGets.set_shard` (kvoffload/core/hot.c): on a worker of a multi-worker daemon C serves a
frame only if every key in it is the worker's by `shard_of` (CRC32C mod the count, computed in
C with the wire extension's CRC32C), and leaves any other frame to the Python session, which
answers it WRONG_SHARD: nothing counted, nothing pinned, the reader where it was."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvoffload import core
from kvoffload.kvstore import DramConfig, Engine, EngineConfig
from kvoffload.nvmeof_target.services import PinBudget
from kvoffload.wire import fast
from kvoffload.wire.native.connection import Get, GetMany, Hello, Lookup, NativeConnection, Role
from kvoffload.wire.native.frames import FrameReader, _State
from kvoffload.wire.shards import shard_of

pytestmark = pytest.mark.skipif(
    core.hot_gets_type() is None, reason="the C core is not built (KVOFFLOAD_PURE_PYTHON run)"
)


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(dram=DramConfig(capacity_bytes=4 << 20, prefault=False)))
    yield engine
    engine.close()


def _hot(engine: Engine, index: int | None = None, count: int = 1) -> object:
    handles = engine.hot_handles()
    hot_type = core.hot_gets_type()
    assert handles is not None and hot_type is not None
    hot = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                   handles.apply_touches, handles.free, handles.arena, None, fast.frame_head,
                   _State.HEAD, handles.touch_ring, pins=PinBudget(1 << 30),
                   max_payload=1 << 30, step=4)  # fmt: skip
    if index is not None:
        hot.set_shard(index, count)
    return hot


def _frames(*requests: object) -> bytes:
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(1 << 30))
    return b"".join(client.send(r) for r in requests)  # type: ignore[arg-type]


def _reader(data: bytes) -> FrameReader:
    reader = FrameReader()
    reader.receive_data(data)
    return reader


@pytest.mark.parametrize("count", [2, 3, 5])
def test_a_get_is_served_exactly_when_its_key_is_the_workers(engine: Engine, count: int) -> None:
    rng = random.Random(count)
    keys = [rng.randbytes(16) for _ in range(60)]
    for key in keys[::2]:
        engine.put(key, b"v" * 100)
    hots = [_hot(engine, i, count) for i in range(count)]
    for key in keys:
        for index, hot in enumerate(hots):
            reader = _reader(_frames(Get(7, key)))
            got = hot.serve(reader, 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
            assert (got is not None) == (shard_of(key, count) == index), (key.hex(), index)
            if got is None:
                assert reader._start == 0  # left for Python as it was
            else:
                hot.release(got[1], got[2], got[6])  # type: ignore[attr-defined]
    stats = engine.stats().as_dict()
    assert stats["gets"] == len(keys)  # each key served by one worker only
    assert stats["tiers"][0]["pinned"] == 0  # type: ignore[index]


def test_a_batch_with_one_key_of_another_shard_is_left_whole(engine: Engine) -> None:
    rng = random.Random(1)
    keys = [rng.randbytes(16) for _ in range(40)]
    mine = [k for k in keys if shard_of(k, 2) == 0][:4]
    theirs = next(k for k in keys if shard_of(k, 2) == 1)
    for key in mine:
        engine.put(key, b"w" * 1000)
    hot = _hot(engine, 0, 2)
    for request in (GetMany(3, (*mine[:2], theirs, *mine[2:])), Lookup(3, (*mine, theirs))):
        reader = _reader(_frames(request))
        assert hot.serve(reader, 0, 1 << 30, 1 << 30) is None  # type: ignore[attr-defined]
        assert reader._start == 0
    assert engine.stats().as_dict()["gets"] == 0
    # A run of frames stops at the first with another shard's key: the rest is Python's.
    data = _frames(Get(4, mine[0]), Lookup(5, tuple(mine)), Get(6, theirs), Get(7, mine[1]))
    reader = _reader(data)
    got = hot.serve(reader, 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
    assert got is not None and got[3] == (1, 0, 1, 0)
    assert bytes(reader._buf[reader._start : reader._end]) == _frames(
        Get(6, theirs), Get(7, mine[1])
    )
    hot.release(got[1], got[2], got[6])  # type: ignore[attr-defined]


@pytest.mark.parametrize("index, count", [(0, 0), (2, 2), (-1, 2), (0, 65537)])
def test_set_shard_refuses_a_bad_role(engine: Engine, index: int, count: int) -> None:
    hot = _hot(engine)
    with pytest.raises(ValueError, match="set_shard"):
        hot.set_shard(index, count)  # type: ignore[attr-defined]
