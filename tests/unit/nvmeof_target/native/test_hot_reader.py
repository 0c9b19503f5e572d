"""The C reader callback (`HotGets.arm`, then the object called as the event loop calls a
reader) on a real DRAM-only engine and a socket pair, called here as the loop would call it:
what one readable event receives and answers, when it stays armed, and how it hands back
(the buffer as the Python read loop then reads it, once, and disarmed)."""

from __future__ import annotations

import errno
import os
import socket
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload import core
from kvoffload.kvstore import DramConfig, Engine, EngineConfig
from kvoffload.wire import fast
from kvoffload.wire.native.connection import Get, Hello, NativeConnection, Put, Role
from kvoffload.wire.native.frames import FrameReader, _State

pytestmark = pytest.mark.skipif(
    core.hot_gets_type() is None, reason="the C core is not built (KVOFFLOAD_PURE_PYTHON run)"
)
KEY, VALUE = bytes(range(16)), b"v" * 5000
DATA, EOF, OSERROR, RAISED = 0, 1, 2, 3  # the hand-back codes (session._BACK_*)


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(dram=DramConfig(capacity_bytes=4 << 20, prefault=False)))
    engine.put(KEY, VALUE)
    yield engine
    engine.close()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    near, far = socket.socketpair()  # near: the daemon's side
    near.setblocking(False)
    yield near, far
    near.close()
    far.close()


class Armed:
    """A HotGets armed on `near` with a fresh reader, recording its hand-backs."""

    def __init__(self, engine: Engine, near: socket.socket, most: int = 7) -> None:
        handles = engine.hot_handles()
        hot_type = core.hot_gets_type()
        assert handles is not None and hot_type is not None
        self.hot: Any = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                                 handles.apply_touches, handles.free, handles.arena, None,
                                 fast.frame_head, _State.HEAD, handles.touch_ring,
                                 buckets=(1e-3, 1.0))  # fmt: skip
        self.reader = FrameReader()
        self.reader.get_buffer()
        self.backs: list[tuple[int, object, object]] = []
        self.services = types.SimpleNamespace(hot_gets=0, hot_exists=0, hot_lookups=0,
                                              hot_get_manys=0, hot_reader_requests=0)  # fmt: skip
        self.hot.arm(self.reader, near.fileno(), most, 1 << 30, self._back, self.services)

    def _back(self, code: int, extra: object, got: object) -> None:
        self.backs.append((code, extra, got))

    @property
    def left(self) -> bytes:
        return bytes(self.reader._buf[self.reader._start : self.reader._end])


def _frames(*events: object) -> bytes:
    """The frames of `events` (the Hello before them not included)."""
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(1 << 30))
    out = b""
    for event in events:
        out += client.send(event, [b"abc"]) if isinstance(event, Put) else client.send(event)
    return out


def _read_all(far: socket.socket, want: int) -> bytes:
    far.settimeout(10)
    out = b""
    while len(out) < want:
        out += far.recv(1 << 20)
    return out


def _python_answer(rid: int, length: int | None) -> bytes:
    """What the Python codec sends for Get `rid` (a hit of `length` bytes or a miss)."""
    server = NativeConnection(Role.SERVER)
    server.receive_data(NativeConnection(Role.CLIENT).send(Hello(1 << 30)) + _frames(Get(rid, KEY)))
    server.next_event()
    server.next_event()
    parts = server.send_get_result(rid, length, (memoryview(VALUE),) if length else ())
    return b"".join(bytes(p) for p in parts)


def test_gets_are_answered_and_it_stays_armed(engine: Engine, pair: Any) -> None:
    near, far = pair
    armed = Armed(engine, near)
    gets = _frames(Get(2, KEY), Get(3, bytes(16)))
    far.sendall(gets)
    armed.hot()
    assert armed.backs == [] and armed.hot.armed  # all answered: waits for the next
    assert armed.services.hot_gets == 2 and armed.services.hot_reader_requests == 2
    assert armed.reader.at_boundary and armed.hot.last_rx > 0
    want = _python_answer(2, len(VALUE)) + _python_answer(3, None)
    assert _read_all(far, len(want)) == want
    assert armed.hot.take_metrics()[0][0] == 2  # counted once, in C, as serve(..., fd) counts
    assert engine.stats().as_dict()["tiers"][0]["pinned"] == 0  # type: ignore[index]
    armed.hot()  # nothing to read: woken for nothing, still armed, nothing handed back
    assert armed.backs == [] and armed.hot.armed


def test_a_put_is_handed_back_with_its_bytes_as_received(engine: Engine, pair: Any) -> None:
    near, far = pair
    armed = Armed(engine, near)
    frames = _frames(Get(2, KEY), Put(3, KEY, 3), Get(4, KEY))
    far.sendall(frames)
    armed.hot()
    ((code, served, got),) = armed.backs
    assert (code, served, got) == (DATA, 1, None) and not armed.hot.armed
    assert armed.left == frames[len(_frames(Get(2, KEY))) :]  # the Put, then the Get
    armed.hot()  # disarmed: a late call does nothing
    assert len(armed.backs) == 1


def test_a_frame_split_across_reads_is_handed_back_partial(engine: Engine, pair: Any) -> None:
    near, far = pair
    armed = Armed(engine, near)
    get = _frames(Get(2, KEY))
    far.sendall(get[:10])
    armed.hot()
    assert armed.backs == [(DATA, 0, None)] and armed.left == get[:10]


def test_the_turn_bounds_what_one_event_answers(engine: Engine, pair: Any) -> None:
    near, far = pair
    armed = Armed(engine, near, most=3)
    frames = _frames(*(Get(2 + i, KEY) for i in range(5)))
    far.sendall(frames)
    armed.hot()
    assert armed.backs == [(DATA, 3, None)]  # three answered, two left for the next turn
    assert armed.left == frames[len(frames) * 3 // 5 :]


def test_eof_and_errors_hand_back(engine: Engine, pair: Any) -> None:
    near, far = pair
    armed = Armed(engine, near)
    far.close()
    armed.hot()
    assert armed.backs == [(EOF, 0, None)] and armed.hot.last_rx > 0
    bad = Armed(engine, near)
    bad.hot.disarm()
    # A pipe, not a socket: recv fails with ENOTSOCK (a just-closed socket's number could be
    # reused meanwhile by another thread's open)
    rfd, wfd = os.pipe()
    try:
        bad.hot.arm(bad.reader, rfd, 7, 1 << 30, bad._back, bad.services)
        bad.hot()
    finally:
        os.close(rfd)
        os.close(wfd)
    assert bad.backs == [(OSERROR, errno.ENOTSOCK, None)] and not bad.hot.armed


def test_arm_refuses_bad_arguments(engine: Engine, pair: Any) -> None:
    near, _ = pair
    armed = Armed(engine, near)
    with pytest.raises(ValueError, match="already armed"):
        armed.hot.arm(armed.reader, near.fileno(), 7, 1 << 30, armed._back, None)
    armed.hot.disarm()
    for fd, most, limit in ((-1, 7, 1), (near.fileno(), 0, 1), (near.fileno(), 7, -1)):
        with pytest.raises(ValueError):
            armed.hot.arm(armed.reader, fd, most, limit, armed._back, None)
    with pytest.raises(TypeError):
        armed.hot.arm(armed.reader, near.fileno(), 7, 1, "not callable", None)
    with pytest.raises(TypeError):
        armed.hot(1)
