"""The C reader callback racing a stop (issue 29's review): whichever of the hand-back and
the session's cancellation (`stop_reading`, a watchdog's `abort`) comes first in a loop
iteration, nothing is read after the stop, and an answer C began is sent whole (or, after an
abort, unpinned) — never dropped with its pins held or cut short. A real engine, the real
`HotGets` and `Channel` on a socket pair with small buffers, so an answer does not fit the
kernel; the session is a real `NativeSession` given only what these paths use."""

from __future__ import annotations

import asyncio
import socket
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload import core
from kvoffload.kvstore import DramConfig, Engine, EngineConfig
from kvoffload.nvmeof_target.channel import Channel
from kvoffload.nvmeof_target.native.session import NativeSession
from kvoffload.nvmeof_target.services import PinBudget
from kvoffload.wire import fast
from kvoffload.wire.native.connection import Get, Hello, NativeConnection, Role
from kvoffload.wire.native.events import Welcome
from kvoffload.wire.native.frames import _State

pytestmark = pytest.mark.skipif(
    core.hot_gets_type() is None, reason="the C core is not built (KVOFFLOAD_PURE_PYTHON run)"
)
KEY, VALUE = bytes(range(16)), b"v" * 200_000


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(dram=DramConfig(capacity_bytes=8 << 20, prefault=False)))
    engine.put(KEY, VALUE)
    yield engine
    engine.close()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    near, far = socket.socketpair()  # near: the daemon's side
    near.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    far.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    far.setblocking(False)
    yield near, far
    near.close()
    far.close()


class Racing:
    """The real HotGets as the loop's reader; `before`/`after` run around the call of it the
    loop makes, in the same iteration, as a stop by another task in it would."""

    def __init__(self, hot: Any) -> None:
        self.hot = hot
        self.before: Any = None
        self.after: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hot, name)

    def __call__(self) -> None:
        if self.before is not None:
            self.before()
        self.hot()
        if self.after is not None and not self.hot.armed:  # it handed back
            self.after()


def _session(engine: Engine, near: socket.socket, pins: PinBudget) -> Any:
    """A session holding what `_read_in_c` and the stop paths use; handshaken, idle, its last
    request answered in C."""
    handles = engine.hot_handles()
    hot_type = core.hot_gets_type()
    assert handles is not None and hot_type is not None
    hot = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                   handles.apply_touches, handles.free, handles.arena, None, fast.frame_head,
                   _State.HEAD, handles.touch_ring, buckets=(1e-3, 1.0), pins=pins,
                   max_payload=1 << 30, step=1)  # fmt: skip
    conn, client = NativeConnection(Role.SERVER), NativeConnection(Role.CLIENT)
    conn.receive_data(client.send(Hello(1 << 30)))
    conn.next_event()
    conn.send_parts(Welcome(1 << 30, 1, "", 1 << 20, 1 << 20))
    services = types.SimpleNamespace(hot_gets=0, hot_exists=0, hot_lookups=0, hot_get_manys=0,
                                     hot_reader_requests=0, hot_reader_handbacks=0)  # fmt: skip
    # The real class, its attributes set here: no daemon, front or metrics behind it.
    s = NativeSession.__new__(NativeSession)
    fields = dict(
        conn=conn, channel=Channel(near, asyncio.get_running_loop()), _hot=Racing(hot),
        _hot_last=True, _tasks=set(), _inflight_bytes=0, puts={}, services=services,
        config=types.SimpleNamespace(max_inflight_bytes=1 << 30), _last_rx=0.0, _steps=0,
        _reading=True, _reader=None, _room=asyncio.Event(), client=client,
    )  # fmt: skip
    for name, value in fields.items():
        setattr(s, name, value)
    s._wake = lambda: None  # type: ignore[method-assign]
    return s


async def _start(s: Any, far: socket.socket) -> asyncio.Task[bool]:
    s._reader = task = asyncio.ensure_future(s._read_in_c())
    for _ in range(100):  # bounded: armed within a few loop turns
        if s._hot.armed:
            break
        await asyncio.sleep(0.01)
    assert s._hot.armed
    far.sendall(s.client.send(Get(7, KEY)))
    return task


async def _receive(far: socket.socket, want: int) -> bytes:
    """What the client side receives until `want` bytes came, EOF or 10 s (bounded)."""
    got, deadline = bytearray(), time.monotonic() + 10
    while len(got) < want and time.monotonic() < deadline:
        try:
            chunk = far.recv(1 << 20)
        except BlockingIOError:
            await asyncio.sleep(0.01)
            continue
        if not chunk:
            break
        got += chunk
    return bytes(got)


def _pinned(engine: Engine) -> int:
    return int(engine.stats().as_dict()["tiers"][0]["pinned"])


@pytest.mark.parametrize("stop", ["cancel", "stop_reading"])
def test_a_stop_after_the_hand_back_still_sends_the_answer_whole(
    engine: Engine, pair: Any, stop: str
) -> None:
    near, far = pair
    pins = PinBudget(1 << 30)

    async def main() -> None:
        s = _session(engine, near, pins)
        task = await _start(s, far)
        s._hot.after = task.cancel if stop == "cancel" else s.stop_reading
        with pytest.raises(asyncio.CancelledError):
            await task
        assert s.services.hot_reader_requests == 1 and not s._hot.armed
        received = await _receive(far, len(VALUE) + 1)
        received += await _receive(far, 1 << 20) if len(received) > len(VALUE) else b""
        # the answer C began is out whole (header and value), then nothing more
        assert len(received) > len(VALUE) and received.endswith(VALUE)
        assert pins.held == 0 and _pinned(engine) == 0 and s._inflight_bytes == 0

    asyncio.run(main())


def test_an_abort_after_the_hand_back_unpins_at_once(engine: Engine, pair: Any) -> None:
    near, far = pair
    pins = PinBudget(1 << 30)

    async def main() -> None:
        s = _session(engine, near, pins)
        task = await _start(s, far)
        s._hot.after = s.abort
        with pytest.raises(asyncio.CancelledError):
            await task
        assert s.services.hot_reader_requests == 1 and s.channel.closed
        # closed: the rest of the answer is dropped with the connection and its pins let go
        assert pins.held == 0 and _pinned(engine) == 0 and s._inflight_bytes == 0

    asyncio.run(main())


@pytest.mark.parametrize("stop", ["stop_reading", "abort"])
def test_nothing_is_read_after_a_stop_in_the_same_iteration(
    engine: Engine, pair: Any, stop: str
) -> None:
    """The stop runs first in the iteration in which the loop found the socket readable: as
    the Python read loop, the session reads nothing more (the request stays in the socket)."""
    near, far = pair
    pins = PinBudget(1 << 30)

    async def main() -> None:
        s = _session(engine, near, pins)
        task = await _start(s, far)
        s._hot.before = getattr(s, stop)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert s.services.hot_reader_requests == 0 and not s._hot.armed
        if stop == "abort":
            assert s.channel.closed
        else:
            assert not s.channel.closed and s.channel.buffered == 0
            assert len(near.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)) > 0
        assert pins.held == 0 and _pinned(engine) == 0

    asyncio.run(main())
