"""`HotGets` (kvoffload/core/hot.c) on a real DRAM-only engine and the codec's own reader:
what it takes (whole canonical Gets, answered byte for byte as the Python codec answers them),
what it leaves to the Python codec untouched (everything else, partial frames, random bytes),
and the pins it gives back."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import core
from kvoffload.kvstore import DramConfig, Engine, EngineConfig
from kvoffload.nvmeof_target.tenants import Tenant
from kvoffload.wire import fast
from kvoffload.wire.native.connection import (
    Exists,
    Get,
    Hello,
    Limits,
    Lookup,
    LookupResult,
    NativeConnection,
    Put,
    Role,
)
from kvoffload.wire.native.frames import FRAME, MAGIC, FrameReader, _State
from kvoffload.wire.tiers import wire_pairs

pytestmark = pytest.mark.skipif(
    core.hot_gets_type() is None, reason="the C core is not built (KVOFFLOAD_PURE_PYTHON run)"
)
KEY, VALUE = bytes(range(16)), b"v" * 5000


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(dram=DramConfig(capacity_bytes=4 << 20, prefault=False)))
    engine.put(KEY, VALUE)
    yield engine
    engine.close()


def _hot(engine: Engine, tenant: Tenant | None = None) -> object:
    handles = engine.hot_handles()
    assert handles is not None
    hot_type = core.hot_gets_type()
    assert hot_type is not None
    return hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                    handles.apply_touches, handles.free, handles.arena,
                    tenant.hasher if tenant else None, fast.frame_head, _State.HEAD,
                    handles.touch_ring)  # fmt: skip


def _reader(data: bytes) -> FrameReader:
    reader = FrameReader()
    reader.receive_data(data)
    return reader


HELLO_ID = 1 << 30  # the Hello's id: apart from the gets'


def _get(rid: int, key: bytes = KEY) -> bytes:
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(HELLO_ID))
    return client.send(Get(rid, key))


def _python_answer(rid: int, length: int | None) -> bytes:
    """What the Python codec sends for the same Get (the server's `send_get_result`)."""
    server, client = NativeConnection(Role.SERVER), NativeConnection(Role.CLIENT)
    server.receive_data(client.send(Hello(HELLO_ID)) + client.send(Get(rid, KEY)))
    server.next_event()
    server.next_event()
    parts = server.send_get_result(rid, length, (memoryview(VALUE),) if length else ())
    return bytes(parts[0])


def test_a_whole_get_is_answered_as_the_python_codec_answers_it(engine: Engine) -> None:
    hot = _hot(engine)
    reader = _reader(_get(7) + _get(8, bytes(16)))
    got = hot.serve(reader, 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
    assert got is not None
    parts, views, entries, counts, out_bytes, size, taken = got
    assert counts == (2, 0, 0, 0) and out_bytes == len(VALUE) and len(entries) == 1
    assert bytes(parts[0]) == _python_answer(7, len(VALUE)) and bytes(parts[1]) == VALUE
    assert bytes(parts[2]) == _python_answer(8, None)  # a miss
    assert size == sum(len(p) for p in parts) and reader.at_boundary
    stats = engine.stats().as_dict()
    assert (stats["gets"], stats["hits"], stats["misses"]) == (2, 1, 1)
    assert stats["tiers"][0]["pinned"] == 1  # type: ignore[index]
    hot.release(views, entries)  # type: ignore[attr-defined]
    hot.release(views, entries)  # type: ignore[attr-defined]  # idempotent
    assert engine.stats().as_dict()["tiers"][0]["pinned"] == 0  # type: ignore[index]


def test_exists_is_answered_as_the_python_codec_answers_it(engine: Engine) -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    frames = client.send(Hello(HELLO_ID)) + client.send(Exists(4, KEY))
    frames += client.send(Exists(5, bytes(16)))
    server.receive_data(frames)
    for _ in range(3):
        server.next_event()
    python = [bytes(server.send_exists_result(4, True)[0]),
              bytes(server.send_exists_result(5, False)[0])]  # fmt: skip
    reader = _reader(frames[frames.index(b"KVNP", 4) :])
    got = _hot(engine).serve(reader, 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
    assert got is not None and got[3] == (0, 2, 0, 0) and not got[2]
    assert [bytes(p) for p in got[0]] == python
    assert engine.stats().as_dict()["gets"] == 0  # an exists is no get


@pytest.mark.parametrize("count", [0, 1, 3, 20, 70_000])
def test_lookup_is_answered_as_the_python_codec_answers_it(engine: Engine, count: int) -> None:
    keys = [KEY if i % 7 else bytes(16) for i in range(count)]  # a miss at 0: then count 0
    keys = [KEY] * (count // 2) + keys[count // 2 :]
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(HELLO_ID))
    frame = client.send(Lookup(6, tuple(keys)))
    expected = next((i for i, k in enumerate(keys) if k != KEY), len(keys))
    server = NativeConnection(Role.SERVER)
    server.receive_data(NativeConnection(Role.CLIENT).send(Hello(HELLO_ID)))
    server.next_event()
    server.receive_data(frame)
    server.next_event()
    python = b"".join(bytes(p) for p in server.send_parts(LookupResult(6, expected)))
    got = _hot(engine).serve(_reader(frame), 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
    assert got is not None and got[3] == (0, 0, 1, 0) and bytes(got[0][0]) == python


@pytest.mark.parametrize("count", [0, 1, 3, 20, 300])
def test_a_lookup_with_tiers_is_answered_as_the_python_codec_answers_it(
    engine: Engine, count: int
) -> None:
    keys = tuple(KEY if i != count // 2 + 1 else bytes(16) for i in range(count))
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(HELLO_ID))
    frame = client.send(Lookup(6, keys, tiers=True))
    server = NativeConnection(Role.SERVER)
    server.receive_data(NativeConnection(Role.CLIENT).send(Hello(HELLO_ID)))
    server.next_event()
    server.receive_data(frame)
    server.next_event()
    where: list[str] = []
    found = engine.lookup(list(keys), where)
    answer = LookupResult(6, found, wire_pairs(where))
    python = b"".join(bytes(p) for p in server.send_parts(answer))
    got = _hot(engine).serve(_reader(frame), 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
    assert got is not None and got[3] == (0, 0, 1, 0) and bytes(got[0][0]) == python


def test_a_lookup_over_the_header_limit_or_not_whole_is_python_s(engine: Engine) -> None:
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(HELLO_ID))
    hot = _hot(engine)
    big = client.send(Lookup(7, (KEY,) * 10))
    reader = FrameReader(Limits(max_header_bytes=100))  # the 10 keys' map is 189 bytes
    reader.receive_data(big)
    assert hot.serve(reader, 0, 1 << 30, 1 << 30) is None  # type: ignore[attr-defined]
    reader = _reader(big[:-1])  # not whole yet
    assert hot.serve(reader, 0, 1 << 30, 1 << 30) is None  # type: ignore[attr-defined]


def test_tenant_keys_are_derived_as_the_tenant_derives_them(engine: Engine) -> None:
    alice = Tenant.named("alice")
    engine.put(alice.key(bytes(16)), b"alice's")
    got = _hot(engine, alice).serve(_reader(_get(3, bytes(16))), 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
    assert got is not None and bytes(got[0][1]) == b"alice's"


def _variants() -> list[bytes]:
    """Frames HotGets must leave to the Python codec, each with the reader's bytes intact."""
    good = _get(5)
    head = bytearray(good[: FRAME.size])
    out = []
    for offset, value in ((4, 2), (5, 7), (6, 1), (7, 0x80)):  # version, op, flags
        bad = bytearray(good)
        bad[offset] = value
        out.append(bytes(bad))
    out.append(bytes(head[:8]) + struct.pack("<I", 0) + good[12:])  # request id 0
    out.append(good[:16] + struct.pack("<Q", 1) + good[24:] + b"x")  # a payload
    out.append(b"XXXX" + good[4:])  # magic
    longer = FRAME.pack(MAGIC, 1, 3, 0, 5, 24, 0) + b"\x81\xd9\x03key\xc4\x10" + KEY
    out.append(longer)  # str8 where the SDK writes fixstr: valid, but Python's to parse
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(HELLO_ID))
    out.append(client.send(Put(5, KEY, 3), [b"abc"]))
    out.append(good[:-1])  # not whole yet
    return out


@pytest.mark.parametrize("data", _variants(), ids=lambda d: d[:8].hex())
def test_anything_else_is_left_untouched(engine: Engine, data: bytes) -> None:
    reader = _reader(data)
    assert _hot(engine).serve(reader, 0, 1 << 30, 1 << 30) is None  # type: ignore[attr-defined]
    assert reader._start == 0 and engine.stats().as_dict()["gets"] == 0


def test_it_stops_at_the_first_frame_it_does_not_take(engine: Engine) -> None:
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(HELLO_ID))
    put = client.send(Put(9, KEY, 3), [b"abc"])
    reader = _reader(_get(1) + _get(2) + put + _get(3))
    got = _hot(engine).serve(reader, 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
    assert got is not None and got[3] == (2, 0, 0, 0)
    assert bytes(reader._buf[reader._start : reader._end]) == put + _get(3)


def test_it_takes_no_more_than_the_turn_allows(engine: Engine) -> None:
    reader = _reader(_get(1) + _get(2) + _get(3))
    got = _hot(engine).serve(reader, 0, 1 << 30, 2)  # type: ignore[attr-defined]
    assert got is not None and got[3] == (2, 0, 0, 0)
    assert bytes(reader._buf[reader._start : reader._end]) == _get(3)


def test_flow_control_and_a_closing_engine_leave_gets_to_python(engine: Engine) -> None:
    hot = _hot(engine)
    reader = _reader(_get(1) + _get(2))
    assert hot.serve(reader, 10, 10, 9) is None  # type: ignore[attr-defined]
    got = hot.serve(reader, 0, 1, 9)  # type: ignore[attr-defined]  # the first answer crosses it
    assert got is not None and got[3] == (1, 0, 0, 0)
    hot.release(got[1], got[2])  # type: ignore[attr-defined]
    engine.close()
    assert hot.serve(reader, 0, 1 << 30, 1 << 30) is None  # type: ignore[attr-defined]


@given(st.binary(max_size=200))
def test_random_bytes_are_never_taken_for_gets(data: bytes) -> None:
    engine = Engine(EngineConfig(dram=DramConfig(capacity_bytes=1 << 20, prefault=False)))
    try:
        reader = _reader(data)
        got = _hot(engine).serve(reader, 0, 1 << 30, 1 << 30)  # type: ignore[attr-defined]
        taken = reader._start
        assert got is None or data[:taken] == b"".join(
            data[i : i + 47] for i in range(0, taken, 47)
        )
        assert got is None or all(data[i : i + 8] == _get(1)[:8] for i in range(0, taken, 47))
    finally:
        engine.close()


BUCKETS = (1e-3, 1.0)


def _hot_sending(engine: Engine) -> object:
    handles = engine.hot_handles()
    assert handles is not None
    hot_type = core.hot_gets_type()
    assert hot_type is not None
    return hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                    handles.apply_touches, handles.free, handles.arena, None, fast.frame_head,
                    _State.HEAD, handles.touch_ring, buckets=BUCKETS)  # fmt: skip


def _pinned(engine: Engine) -> int:
    return int(engine.stats().as_dict()["tiers"][0]["pinned"])  # type: ignore[index]


def test_with_a_socket_it_sends_counts_and_unpins_at_once(engine: Engine) -> None:
    hot = _hot_sending(engine)
    near, far = socket.socketpair()
    with near, far:
        near.setblocking(False)
        frames = _get(7) + _get(8, bytes(16))
        got = hot.serve(_reader(frames), 0, 1 << 30, 1 << 30, near.fileno())  # type: ignore[attr-defined]
        assert got is not None
        parts, views, entries, counts, out_bytes, size, taken = got
        assert parts == [] and views == [] and entries == [] and counts == (2, 0, 0, 0)
        expected = _python_answer(7, len(VALUE)) + VALUE + _python_answer(8, None)
        assert size == len(expected) and _recv_exactly(far, size) == expected
        assert _pinned(engine) == 0  # released in the call: no completion callback
        (gets, exists, lookups, many, puts), sent, buckets, sums, got_in = hot.take_metrics()  # type: ignore[attr-defined]
        assert (gets, exists, lookups, puts, sent, got_in) == (2, 0, 0, 0, len(VALUE), 0)
        assert sum(buckets[0]) == 2 and len(buckets[0]) == len(BUCKETS) + 1
        assert buckets[1] == buckets[2] == (0, 0, 0) and sums[0] > 0 and sums[1] == 0
        assert hot.take_metrics()[:2] == ((0, 0, 0, 0, 0), 0)  # type: ignore[attr-defined]  # taken


def test_what_a_full_socket_leaves_stays_pinned_for_the_channel(engine: Engine) -> None:
    big = b"b" * (1 << 20)
    engine.put(KEY, big)
    hot = _hot_sending(engine)
    near, far = socket.socketpair()
    with near, far:
        near.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        near.setblocking(False)
        got = hot.serve(_reader(_get(7)), 0, 1 << 30, 1 << 30, near.fileno())  # type: ignore[attr-defined]
        assert got is not None
        rest, views, entries, counts, _, size, _taken = got
        left = sum(len(p) for p in rest)
        assert 0 < left < size and len(entries) == 1 and _pinned(engine) == 1
        near.setblocking(True)
        sender = threading.Thread(target=lambda: [near.sendall(p) for p in rest])
        sender.start()  # what the Channel would send, while the peer reads
        received = _recv_exactly(far, size)
        sender.join()
        assert received == _answer_head(7, len(big)) + big
        hot.release(views, entries)  # type: ignore[attr-defined]
        assert _pinned(engine) == 0


def test_a_socket_needs_the_buckets_and_the_buckets_must_be_sane(engine: Engine) -> None:
    near, far = socket.socketpair()
    with near, far, pytest.raises(ValueError, match="buckets"):
        _hot(engine).serve(_reader(_get(7)), 0, 1 << 30, 1 << 30, near.fileno())  # type: ignore[attr-defined]
    handles = engine.hot_handles()
    assert handles is not None
    hot_type = core.hot_gets_type()
    assert hot_type is not None
    for bad in ((), (1.0, 0.5), tuple(range(1, 40))):
        with pytest.raises(ValueError, match="buckets"):
            hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                     handles.apply_touches, handles.free, handles.arena, None, fast.frame_head,
                     _State.HEAD, handles.touch_ring, buckets=bad)  # fmt: skip


def _answer_head(rid: int, length: int) -> bytes:
    server, client = NativeConnection(Role.SERVER), NativeConnection(Role.CLIENT)
    server.receive_data(client.send(Hello(HELLO_ID)) + client.send(Get(rid, KEY)))
    server.next_event()
    server.next_event()
    return bytes(server.send_get_result(rid, length, (memoryview(b"x" * length),))[0])


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk
        out += chunk
    return bytes(out)


def _put_done_bytes(rid: int) -> list[bytes]:
    """What the Python codec answers a Put with (`send_put_done`): the parts `put_done` sends."""
    server, client = NativeConnection(Role.SERVER), NativeConnection(Role.CLIENT)
    server.receive_data(client.send(Hello(HELLO_ID)) + client.send(Put(rid, KEY, 0)))
    server.next_event()
    server.next_event()
    return [bytes(p) for p in server.send_put_done(rid)]


def test_put_done_sends_the_codecs_answer_and_counts_a_put(engine: Engine) -> None:
    hot = _hot_sending(engine)
    near, far = socket.socketpair()
    with near, far:
        near.setblocking(False)
        parts = _put_done_bytes(9)
        t0 = time.perf_counter() - 100  # the session's clock: C's latency must be from it
        rest = hot.put_done(parts, near.fileno(), t0, 65536)  # type: ignore[attr-defined]
        assert rest == [] and _recv_exactly(far, len(parts[0])) == parts[0]
        counts, sent, buckets, sums, got_in = hot.take_metrics()  # type: ignore[attr-defined]
        assert counts == (0, 0, 0, 0, 1) and sent == 0 and got_in == 65536
        assert buckets[4] == (0, 0, 1) and sums[4] >= 100  # past the last bound: +Inf
        assert hot.take_metrics()[0] == (0, 0, 0, 0, 0) and hot.take_metrics()[4] == 0  # type: ignore[attr-defined]


def test_put_done_on_a_full_socket_hands_the_rest_back_counted(engine: Engine) -> None:
    hot = _hot_sending(engine)
    near, far = socket.socketpair()
    with near, far:
        near.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        near.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                near.send(b"f" * 4096)  # fill it: the kernel takes nothing more
        parts = _put_done_bytes(10)
        rest = hot.put_done(parts, near.fileno(), time.perf_counter(), 7)  # type: ignore[attr-defined]
        assert b"".join(rest) == parts[0]  # for the Channel, in order after what is queued
        counts, _, _, _, got_in = hot.take_metrics()  # type: ignore[attr-defined]
        assert counts[4] == 1 and got_in == 7  # counted as the Python path counts before it writes


def test_put_done_refuses_what_it_cannot_do(engine: Engine) -> None:
    near, far = socket.socketpair()
    with near, far:
        parts = _put_done_bytes(11)
        with pytest.raises(ValueError, match="buckets"):
            _hot(engine).put_done(parts, near.fileno(), 0.0, 1)  # type: ignore[attr-defined]
        hot = _hot_sending(engine)
        for fd, nbytes in ((-1, 1), (near.fileno(), -1)):
            with pytest.raises(ValueError, match="nbytes"):
                hot.put_done(parts, fd, 0.0, nbytes)  # type: ignore[attr-defined]
        with pytest.raises(TypeError, match="bytes"):
            hot.put_done([memoryview(parts[0])], near.fileno(), 0.0, 1)  # type: ignore[attr-defined]
        with pytest.raises(TypeError):
            hot.put_done(tuple(parts), near.fileno(), 0.0, 1)  # type: ignore[attr-defined]
        assert hot.take_metrics()[0] == (0, 0, 0, 0, 0)  # type: ignore[attr-defined]


def test_put_done_refuses_bytes_in_past_63_bits_before_it_sends(engine: Engine) -> None:
    hot = _hot_sending(engine)
    near, far = socket.socketpair()
    with near, far:
        far.setblocking(False)
        assert hot.put_done([], near.fileno(), 0.0, 2**63 - 1) == []  # type: ignore[attr-defined]
        with pytest.raises(OverflowError, match="2\\*\\*63"):
            hot.put_done(_put_done_bytes(12), near.fileno(), 0.0, 1)  # type: ignore[attr-defined]
        with pytest.raises(BlockingIOError):
            far.recv(100)  # nothing was sent
        counts, _, _, _, got_in = hot.take_metrics()  # type: ignore[attr-defined]
        assert counts[4] == 1 and got_in == 2**63 - 1  # the refused one counted nothing
