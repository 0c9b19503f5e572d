"""Puts taken by the C reader callback (`HotGets.take_puts`, hot.c; `puts.c_put_begin` and
`c_put_commit`): a canonical Put header starts the put in C, its payload arrives straight into
the reserved slot across readable events, and C answers it and stays the reader. A put C holds
when the session stops, aborts or meets EOF becomes the Python codec's, which gives its slot
back as it does for its own puts: no arena bytes or pins are left behind. A real engine, the
real `HotGets`, `Channel` and put handlers on a socket pair; the session is a real
`NativeSession` given only what these paths use."""

from __future__ import annotations

import asyncio
import socket
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload import core
from kvoffload.errors import RemoteProtocolError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig
from kvoffload.nvmeof_target.channel import Channel
from kvoffload.nvmeof_target.native.puts import c_put_begin, c_put_commit
from kvoffload.nvmeof_target.native.session import NativeSession
from kvoffload.nvmeof_target.services import PinBudget
from kvoffload.nvmeof_target.tenants import Tenant
from kvoffload.wire import fast
from kvoffload.wire.native.connection import (
    NEED_DATA,
    ErrorReply,
    Get,
    Hello,
    NativeConnection,
    PayloadEnd,
    Put,
    PutDone,
    Role,
)
from kvoffload.wire.native.events import Welcome
from kvoffload.wire.native.frames import _State
from kvoffload.wire.status import Status

pytestmark = pytest.mark.skipif(
    core.hot_gets_type() is None, reason="the C core is not built (KVOFFLOAD_PURE_PYTHON run)"
)
KEY, OLD = bytes(range(16)), b"o" * 1000


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(dram=DramConfig(capacity_bytes=8 << 20, prefault=False)))
    yield engine
    engine.close()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    near, far = socket.socketpair()  # near: the daemon's side
    yield near, far
    near.close()
    far.close()


def _session(engine: Engine, near: socket.socket, tenant: Tenant) -> Any:
    """Handshaken, idle, its last request answered in C, the C reader taking puts."""
    handles = engine.hot_handles()
    hot_type = core.hot_gets_type()
    assert handles is not None and hot_type is not None
    hot = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                   handles.apply_touches, handles.free, handles.arena, tenant.hasher,
                   fast.frame_head, _State.HEAD, handles.touch_ring, buckets=(1e-3, 1.0),
                   pins=PinBudget(1 << 30), max_payload=1 << 30, step=1)  # fmt: skip
    conn, client = NativeConnection(Role.SERVER), NativeConnection(Role.CLIENT)
    conn.receive_data(client.send(Hello(1 << 30)))
    conn.next_event()
    conn.send_parts(Welcome(1 << 30, 1, "", 1 << 20, 1 << 20))
    services = types.SimpleNamespace(hot_gets=0, hot_exists=0, hot_lookups=0, hot_get_manys=0,
                                     hot_reader_requests=0, hot_reader_handbacks=0,
                                     hot_put_answers=0, hot_reader_puts=0, events=None,
                                     shard=None)  # fmt: skip
    s = NativeSession.__new__(NativeSession)  # the real class, no daemon or front behind it
    fields = dict(
        conn=conn, channel=Channel(near, asyncio.get_running_loop()), _hot=hot,
        _hot_last=True, _tasks=set(), _inflight_bytes=0, puts={}, services=services,
        config=types.SimpleNamespace(max_inflight_bytes=1 << 30, frame_timeout_s=5.0,
                                     idle_timeout_s=60.0), _last_rx=0.0, _steps=0,
        _reading=True, _reader=None, _room=asyncio.Event(), client=client, engine=engine,
        _waits=0, nixl=None, _frame_since=None, _created=time.monotonic(),
        tenant=tenant, _started={}, front=types.SimpleNamespace(c_puts=(1, 2)), shard=None,
    )  # fmt: skip
    for name, value in fields.items():
        setattr(s, name, value)
    s._wake = lambda: None  # type: ignore[method-assign]
    hot.take_puts(lambda *a: c_put_begin(s, *a), lambda put: c_put_commit(s, put))
    return s


def _dram(engine: Engine) -> dict[str, Any]:
    tier: dict[str, Any] = engine.stats().as_dict()["tiers"][0]
    return tier


async def _until(check: Any) -> None:
    for _ in range(500):  # bounded: a few loop turns on a quiet machine, 5 s at most
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached in 5 s")


async def _armed(s: Any) -> asyncio.Task[bool]:
    s._reader = task = asyncio.ensure_future(s._read_in_c())
    await _until(lambda: s._hot.armed)
    return task


async def _answers(s: Any, far: socket.socket, n: int) -> list[object]:
    """The next `n` answers on the client side (a payload as its bytes)."""
    far.setblocking(False)
    out: list[object] = []
    deadline = time.monotonic() + 10
    while len(out) < n and time.monotonic() < deadline:
        try:
            data = far.recv(1 << 20)
        except BlockingIOError:
            await asyncio.sleep(0.01)
            continue
        s.client.receive_data(data)
        while (event := s.client.next_event()) is not NEED_DATA:
            out.append(bytes(event.data) if isinstance(event, PayloadEnd) else event)
    return out


@pytest.mark.parametrize("tenant", [Tenant(""), Tenant.named("alice")], ids=["open", "tenant"])
def test_a_put_split_across_reads_lands_in_its_slot(
    engine: Engine, pair: Any, tenant: Tenant
) -> None:
    near, far = pair
    value = bytes(range(256)) * 300  # 76,800 bytes: more than the codec's buffer

    async def main() -> None:
        s = _session(engine, near, tenant)
        task = await _armed(s)
        frame = s.client.send(Put(5, KEY, len(value)), [value])
        # the header and a few payload bytes, then the rest of the payload in parts (a header
        # cut short goes back to Python, as any partial frame does)
        cuts = [100, 70_000, 70_001, len(frame)]
        at = 0
        for cut in cuts:
            far.sendall(frame[at:cut])
            at = cut
            await asyncio.sleep(0.05)  # (not a timing assertion: separate reads, mostly)
        assert await _answers(s, far, 1) == [PutDone(5)]
        assert s._hot.armed and not task.done()  # C answered and is still the reader
        assert s.services.hot_reader_puts == s.services.hot_put_answers == 1
        assert s.services.hot_reader_handbacks == 0 and not s.conn.pending
        view = engine.get(tenant.key(KEY))
        assert view is not None and bytes(view.data) == value
        view.release()
        # a pipelined put then get: the put answered in C, then the bytes after it handed back
        # to the Python codec (as a frame C does not take is)
        far.sendall(s.client.send(Put(6, KEY, 3), [b"abc"]) + s.client.send(Get(7, KEY)))
        assert await _answers(s, far, 1) == [PutDone(6)]
        assert await task and not s._hot.armed and s.services.hot_reader_handbacks == 1
        assert s.conn.next_event() == Get(7, KEY) and s.services.hot_reader_puts == 2
        assert _dram(engine)["pinned"] == 0

    asyncio.run(main())


@pytest.mark.parametrize("stop", ["stop_reading", "abort", "eof"])
def test_a_put_half_received_gives_its_slot_back(engine: Engine, pair: Any, stop: str) -> None:
    """Stopped, aborted or cut off by EOF while C receives the payload: the put becomes the
    codec's (a stop leaves it unanswered, EOF is the Python path's protocol error) and the
    session's `_abandon` gives the slot back; the key keeps its old value."""
    near, far = pair
    engine.put(KEY, OLD)
    before = _dram(engine)
    value = b"n" * 200_000

    async def main() -> None:
        s = _session(engine, near, Tenant(""))
        task = await _armed(s)
        frame = s.client.send(Put(5, KEY, len(value)), [value])
        far.sendall(frame[: len(frame) // 2])
        await _until(lambda: _dram(engine)["used_bytes"] > before["used_bytes"])  # reserved
        # a payload stalled in C is inside a frame: the frame timeout applies, as in Python
        assert s.overdue(time.monotonic()) == ""
        assert s.overdue(time.monotonic() + 6) == "frame timeout"
        if stop == "eof":
            far.shutdown(socket.SHUT_WR)
            assert await task  # EOF handed back: the Python loop goes on from here
            with pytest.raises(RemoteProtocolError, match="middle of a frame"):
                s.conn.next_event()
        else:
            getattr(s, stop)()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert not s._hot.armed and list(s.puts) == [5] and s.conn.pending == 1
        s._abandon()  # what `_finish` does once the session is over
        after = _dram(engine)
        assert after["used_bytes"] == before["used_bytes"] and after["pinned"] == 0
        view = engine.get(KEY)
        assert view is not None and bytes(view.data) == OLD
        view.release()

    asyncio.run(main())


def test_a_put_c_held_goes_on_in_the_python_codec(engine: Engine, pair: Any) -> None:
    """After a stop_reading the put C held is the codec's, its sink the rest of the slot: the
    remaining bytes complete it exactly as a put the Python loop had started."""
    near, far = pair
    value = bytes(range(200)) * 500

    async def main() -> None:
        s = _session(engine, near, Tenant(""))
        task = await _armed(s)
        frame = s.client.send(Put(5, KEY, len(value)), [value])
        far.sendall(frame[:5000])
        await _until(lambda: _dram(engine)["used_bytes"] > 0)
        s._stop_c_reader()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        s.conn.receive_data(frame[5000:])
        assert s.conn.next_event() == PayloadEnd(5)
        assert engine.get(KEY) is None  # not committed before its end
        s.puts.pop(5).reserved[0].commit()
        view = engine.get(KEY)
        assert view is not None and bytes(view.data) == value
        view.release()

    asyncio.run(main())


def test_a_put_c_receives_is_busy_for_the_idle_timeout(engine: Engine, pair: Any) -> None:
    """Idle 1 s, frame 5 s, half a payload: only the frame timeout applies, in C as in the
    Python codec (where the put is pending). `overdue` is driven with explicit times."""
    near, far = pair
    value = b"v" * 200_000

    async def main() -> None:
        s = _session(engine, near, Tenant(""))
        s.config.idle_timeout_s = 1.0
        task = await _armed(s)
        frame = s.client.send(Put(5, KEY, len(value)), [value])
        far.sendall(frame[: len(frame) // 2])
        await _until(lambda: s._hot.put_arriving)
        t = max(s._last_rx, s._hot.last_rx)
        in_c = [s.overdue(t + 2), s.overdue(t + 6)]
        s._stop_c_reader()  # the same put, now the Python codec's
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        s._frame_since = s._hot.put_started  # as the read loop sets it inside a frame
        in_python = [s.overdue(t + 2), s.overdue(t + 6)]
        assert in_c == in_python == ["", "frame timeout"]
        s._abandon()

    asyncio.run(main())


def test_a_slot_of_the_wrong_size_raises_and_gives_it_back(engine: Engine, pair: Any) -> None:
    """A fault after `begin` (a slot one byte short): the error reaches the session (no hang),
    the reservation is aborted, and the frame is still the codec's, whole."""
    near, far = pair
    value = b"w" * 3000

    async def main() -> None:
        s = _session(engine, near, Tenant(""))

        def short_begin(*args: Any) -> Any:
            slot, token = c_put_begin(s, *args)  # type: ignore[misc]
            return slot[:-1], token

        s._hot.take_puts(short_begin, lambda put: c_put_commit(s, put))
        task = await _armed(s)
        far.sendall(s.client.send(Put(5, KEY, len(value)), [value]))
        with pytest.raises(ValueError, match="not the value's size"):
            await asyncio.wait_for(task, 10)
        assert not s._hot.armed and s._hot.take_put() is None and not s.puts
        assert _dram(engine)["used_bytes"] == 0 and _dram(engine)["pinned"] == 0
        assert s.conn.next_event() == Put(5, KEY, len(value))  # the header not consumed

    asyncio.run(main())


async def _quarter_put(
    engine: Engine, near: socket.socket, far: socket.socket
) -> tuple[Any, asyncio.Task[bool]]:
    """A session with C armed, receiving the payload of a 200 kB put 5 of which the first
    50 kB were sent."""
    s = _session(engine, near, Tenant(""))
    task = await _armed(s)
    far.sendall(s.client.send(Put(5, KEY, 200_000), [b"q" * 200_000])[:50_000])
    await _until(lambda: s._hot.put_arriving)
    return s, task


def test_a_hand_back_that_raises_still_resolves_and_aborts(engine: Engine, pair: Any) -> None:
    """EOF mid-payload, and the codec refuses the put C held (a fault in `admit`): the session
    gets the error instead of awaiting forever, and `_abandon` gives the slot back."""
    near, far = pair

    async def main() -> None:
        s, task = await _quarter_put(engine, near, far)

        def broken_admit(event: object) -> None:
            raise RuntimeError("admit fault")

        s.conn.admit = broken_admit
        far.shutdown(socket.SHUT_WR)
        with pytest.raises(RuntimeError, match="admit fault"):
            await asyncio.wait_for(task, 10)
        assert list(s.puts) == [5]
        s._abandon()
        assert _dram(engine)["used_bytes"] == 0 and _dram(engine)["pinned"] == 0

    asyncio.run(main())


def test_forgetting_a_session_with_a_put_held_is_loud_and_aborts_it(
    engine: Engine, pair: Any, caplog: pytest.LogCaptureFixture
) -> None:
    near, far = pair

    async def main() -> None:
        s, task = await _quarter_put(engine, near, far)
        s._hot.disarm()  # a bug's shape: disarmed without `_stop_c_reader` taking the put
        s.channel.unwatch()
        task.cancel()
        forgotten: list[object] = []
        s._instruments = types.SimpleNamespace(fold=lambda hot: None, hot=set())
        s.front = types.SimpleNamespace(forget=forgotten.append)
        s.peer = "test"
        s._forget()
        assert forgotten == [s] and "forgotten with a put C held" in caplog.text
        assert _dram(engine)["used_bytes"] == 0 and _dram(engine)["pinned"] == 0

    asyncio.run(main())


def test_a_refused_reservation_leaves_the_next_read_to_python(pair: Any) -> None:
    """C took the header but the engine refused the slot: answered in Python, so the next
    read is Python's (`_hot_last`), as after any request Python answered."""
    near, far = pair
    small = Engine(EngineConfig(dram=DramConfig(capacity_bytes=1 << 20, prefault=False)))
    value = b"z" * (2 << 20)  # larger than the whole tier: refused

    async def main() -> None:
        s = _session(small, near, Tenant(""))
        task = await _armed(s)
        far.sendall(s.client.send(Put(5, KEY, len(value)), [value])[:1000])
        assert await asyncio.wait_for(task, 10)
        assert 5 in s.puts and s.puts[5].error is not None
        assert not s._hot_last
        s._abandon()

    try:
        asyncio.run(main())
    finally:
        small.close()


def test_a_commit_refused_by_a_closing_engine_is_answered_in_python(pair: Any) -> None:
    """The engine begins to close while C receives a put's payload: `c_put_commit`'s commit
    fails, the put is answered in Python with the engine's error (counted as a put with that
    status), its slot given back, C hands back and the next read is Python's."""
    near, far = pair
    engine = Engine(EngineConfig(dram=DramConfig(capacity_bytes=8 << 20, prefault=False)))
    value = b"c" * 200_000
    counted: list[tuple[str, str]] = []

    async def main() -> None:
        s = _session(engine, near, Tenant(""))
        s._instruments = lambda op, status: (
            types.SimpleNamespace(inc=lambda: counted.append((op, status))),
            types.SimpleNamespace(observe=lambda seconds: None),
        )
        task = await _armed(s)
        frame = s.client.send(Put(5, KEY, len(value)), [value])
        far.sendall(frame[:50_000])
        await _until(lambda: s._hot.put_arriving)
        with engine._lock:  # what `Engine.close` does first: later calls fail
            engine._m.begin_close()
        far.sendall(frame[50_000:])
        (answer,) = await _answers(s, far, 1)
        assert isinstance(answer, ErrorReply) and answer.request_id == 5, answer
        assert "clos" in answer.message and counted == [("put", Status(answer.status).name.lower())]
        assert await asyncio.wait_for(task, 10) and not s._hot.armed
        assert not s._hot_last and not s.puts and s.services.hot_put_answers == 0
        assert _dram(engine)["used_bytes"] == 0 and _dram(engine)["pinned"] == 0

    try:
        asyncio.run(main())
    finally:
        engine._close(False)  # the rest of `Engine.close` after its first step
        engine._m.closed_event.set()
