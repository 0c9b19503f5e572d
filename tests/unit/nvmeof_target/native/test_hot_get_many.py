"""`HotGets` serving GetMany (kvoffload/core/hot.c) on a real DRAM-only engine, against what
`requests.on_get_many` does: the same answer bytes, the same engine counters, the answer cut
short where the frame's payload limit or the daemon's pin budget says (the rest of the chunk
unpinned, every key of a chunk counted), and the pins and budget bytes given back once."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvoffload import core
from kvoffload.kvstore import DramConfig, Engine, EngineConfig
from kvoffload.nvmeof_target.services import PinBudget
from kvoffload.wire import fast
from kvoffload.wire.native.connection import (
    GetMany,
    GetManyResult,
    Hello,
    NativeConnection,
    Role,
)
from kvoffload.wire.native.frames import FrameReader, _State

pytestmark = pytest.mark.skipif(
    core.hot_gets_type() is None, reason="the C core is not built (KVOFFLOAD_PURE_PYTHON run)"
)
HELLO_ID = 1 << 30
KEYS = [bytes([i]) * 16 for i in range(1, 9)]
VALUES = {k: bytes([k[0]]) * (1000 * k[0]) for k in KEYS[:6]}  # the last two keys miss


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(dram=DramConfig(capacity_bytes=4 << 20, prefault=False)))
    for key, value in VALUES.items():
        engine.put(key, value)
    yield engine
    engine.close()


def _hot(engine: Engine, pins: PinBudget | None, max_payload: int = 1 << 30, step: int = 4,
         buckets: tuple[float, ...] | None = None) -> object:  # fmt: skip
    handles = engine.hot_handles()
    hot_type = core.hot_gets_type()
    assert handles is not None and hot_type is not None
    return hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                    handles.apply_touches, handles.free, handles.arena, None, fast.frame_head,
                    _State.HEAD, handles.touch_ring, buckets=buckets, pins=pins,
                    max_payload=max_payload, step=step)  # fmt: skip


def _frame(rid: int, keys: list[bytes]) -> bytes:
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(HELLO_ID))
    return client.send(GetMany(rid, tuple(keys)))


def _reader(data: bytes) -> FrameReader:
    reader = FrameReader()
    reader.receive_data(data)
    return reader


def _python_answer(rid: int, keys: list[bytes]) -> bytes:
    """The Python codec's answer for these keys, whole."""
    server = NativeConnection(Role.SERVER)
    server.receive_data(NativeConnection(Role.CLIENT).send(Hello(HELLO_ID)) + _frame(rid, keys))
    server.next_event()
    server.next_event()
    hits = [VALUES[k] for k in keys if k in VALUES]
    lengths = tuple(len(VALUES[k]) if k in VALUES else None for k in keys)
    return b"".join(bytes(p) for p in server.send_parts(GetManyResult(rid, lengths), hits))


def _counters(engine: Engine) -> tuple[int, int, int, int]:
    s = engine.stats().as_dict()
    return int(s["gets"]), int(s["hits"]), int(s["misses"]), int(s["tiers"][0]["pinned"])  # type: ignore[index]


@pytest.mark.parametrize("count", [0, 1, 3, 8, 20])
def test_a_get_many_is_answered_as_the_python_codec_answers_it(engine: Engine, count: int) -> None:
    keys = [KEYS[i % len(KEYS)] for i in range(count)]
    pins = PinBudget(1 << 30)
    hot = _hot(engine, pins)
    got = hot.serve(_reader(_frame(5, keys)), 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
    assert got is not None
    parts, views, entries, counts, out_bytes, size, taken = got
    hit_bytes = sum(len(VALUES[k]) for k in keys if k in VALUES)
    assert counts == (0, 0, 0, 1) and out_bytes == taken == pins.held == hit_bytes
    assert b"".join(bytes(p) for p in parts) == _python_answer(5, keys)
    assert size == sum(len(p) for p in parts)
    hits = sum(k in VALUES for k in keys)
    assert _counters(engine) == (count, hits, count - hits, len({k for k in keys if k in VALUES}))
    hot.release(views, entries, taken)  # type: ignore[attr-defined]
    hot.release(views, entries, taken)  # type: ignore[attr-defined]  # idempotent: once only
    assert pins.held == 0 and _counters(engine)[3] == 0


def test_the_payload_limit_cuts_the_answer_short_as_python_does(engine: Engine) -> None:
    """A limit under the first three hits: two hits answered; the chunk of four keys counted
    whole (as `engine.get_many` counts it) and its other keys unpinned; the next chunk unread."""
    keys = KEYS[:8]
    limit = len(VALUES[KEYS[0]]) + len(VALUES[KEYS[1]]) + 1
    pins = PinBudget(1 << 30)
    hot = _hot(engine, pins, max_payload=limit, step=4)
    got = hot.serve(_reader(_frame(9, keys)), 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
    assert got is not None
    parts, views, entries, _, out_bytes, _, taken = got
    assert b"".join(bytes(p) for p in parts) == _python_answer(9, keys[:2])
    assert len(entries) == 2 and taken == out_bytes == pins.held == limit - 1
    assert _counters(engine) == (4, 4, 0, 2)
    hot.release(views, entries, taken)  # type: ignore[attr-defined]
    assert pins.held == 0 and _counters(engine)[3] == 0


def test_the_first_hit_always_fits_and_the_budget_cuts_the_rest(engine: Engine) -> None:
    """The daemon-wide pin budget nearly spent by other answers: the first value still goes
    (a client could never read a block otherwise), the second does not."""
    pins = PinBudget(100)
    pins.held = 90
    keys = [KEYS[7], KEYS[2], KEYS[3]]  # a miss, then two hits
    hot = _hot(engine, pins)
    got = hot.serve(_reader(_frame(3, keys)), 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
    assert got is not None
    parts, views, entries, _, _, _, taken = got
    assert b"".join(bytes(p) for p in parts) == _python_answer(3, keys[:2])
    assert taken == len(VALUES[KEYS[2]]) and pins.held == 90 + taken
    hot.release(views, entries, taken)  # type: ignore[attr-defined]
    assert pins.held == 90 and _counters(engine)[3] == 0


def test_without_a_pin_budget_a_get_many_is_left_to_python(engine: Engine) -> None:
    reader = _reader(_frame(4, KEYS[:2]))
    assert _hot(engine, None).serve(reader, 0, 1 << 30, 1 << 30) is None  # type: ignore[attr-defined]
    assert _counters(engine) == (0, 0, 0, 0) and not reader.at_boundary


def test_a_closing_engine_leaves_a_get_many_to_python(engine: Engine) -> None:
    hot = _hot(engine, PinBudget(1 << 30))
    engine.close()
    reader = _reader(_frame(4, KEYS[:2]))
    assert hot.serve(reader, 0, 1 << 30, 1 << 30) is None  # type: ignore[attr-defined]


def test_bad_budget_arguments_are_refused(engine: Engine) -> None:
    for step, max_payload in ((0, 10), (70_000, 10), (4, 0)):
        with pytest.raises(ValueError, match="step"):
            _hot(engine, PinBudget(10), max_payload=max_payload, step=step)


def test_with_a_socket_it_sends_and_gives_everything_back_at_once(engine: Engine) -> None:
    pins = PinBudget(1 << 30)
    hot = _hot(engine, pins, buckets=(1e-3, 1.0))
    keys = KEYS[:3] + KEYS[7:]
    near, far = socket.socketpair()
    with near, far:
        near.setblocking(False)
        got = hot.serve(_reader(_frame(6, keys)), 0, 1 << 30, 1 << 30, near.fileno())  # type: ignore[attr-defined]
        assert got is not None
        parts, views, entries, counts, _, size, _ = got
        assert parts == views == entries == [] and counts == (0, 0, 0, 1)
        expected = _python_answer(6, keys)
        received = b""
        while len(received) < size:
            received += far.recv(size - len(received))
        assert received == expected and pins.held == 0 and _counters(engine)[3] == 0
        (_, _, _, many, _), sent, buckets, _, _ = hot.take_metrics()  # type: ignore[attr-defined]
        assert many == 1 and sent == sum(len(VALUES[k]) for k in keys if k in VALUES)
        assert sum(buckets[3]) == 1
