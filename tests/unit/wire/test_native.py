"""The native protocol codec without sockets: a client and a server codec passing bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.errors import LocalProtocolError, RemoteProtocolError
from kvoffload.wire import fast
from kvoffload.wire.blockmeta import BlockMeta
from kvoffload.wire.native import events as native_events
from kvoffload.wire.native.connection import (
    NEED_DATA,
    Auth,
    Challenge,
    ConnectionClosed,
    Delete,
    DeleteResult,
    ErrorReply,
    Event,
    Exists,
    ExistsResult,
    Get,
    GetMany,
    GetManyResult,
    GetResult,
    Hello,
    Lookup,
    LookupResult,
    NativeConnection,
    PayloadEnd,
    Prefetch,
    PrefetchResult,
    Put,
    PutDone,
    PutMany,
    PutManyDone,
    Role,
    Stats,
    StatsResult,
    Welcome,
)
from kvoffload.wire.native.frames import FRAME, MAGIC, Limits

K1, K2, K3 = bytes(16), bytes(range(16)), b"\xff" * 16
N32 = bytes(range(32))


@pytest.fixture(autouse=True, params=fast.available())
def implementation(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here runs with the C fast path (when it built) and with pure Python."""
    previous = fast.use(request.param)
    yield request.param
    fast.use(previous)


Item = Event | PayloadEnd | ConnectionClosed

# A session: (event, payload) sent by the client, then by the server.
REQUESTS: list[tuple[Event, list[bytes]]] = [
    (Hello(1, token="secret", client="test"), []),
    (Put(2, K1, 5, parent=K2, durable=False), [b"he", b"llo"]),
    (Get(3, K1), []),
    (Exists(4, K2), []),
    (Delete(5, K1), []),
    (PutMany(6, (K1, K2), (3, 0), (None, K1)), [b"abc"]),
    (GetMany(7, (K1, K2, K3)), []),
    (Lookup(8, (K1, K2, K3)), []),
    (Prefetch(9, (K3,)), []),
    (Stats(10), []),
    (Get(11, K3), []),
    (Put(12, K2, 2, block_meta=BlockMeta((1, 2, 3), block_hash=9).encode()), [b"hi"]),
    (PutMany(13, (K1, K2), (1, 1), (), False, (None, BlockMeta((7,)).encode())), [b"ab"]),
    (Lookup(14, (K1, K2, K3), tiers=True), []),
]
ANSWERS: list[tuple[Event, list[bytes]]] = [
    (Welcome(1, 1, "alice", 1 << 20, 1 << 30, server="kvoffload"), []),
    (GetResult(3, 5), [b"hello"]),  # out of order: multiplexed by id
    (PutDone(2), []),
    (ExistsResult(4, True), []),
    (DeleteResult(5, False), []),
    (PutManyDone(6), []),
    (GetManyResult(7, (3, None)), [b"abc"]),
    (LookupResult(8, 2), []),
    (PrefetchResult(9, 1), []),
    (StatsResult(10, {"puts": 3, "tiers": [{"name": "dram"}]}), []),
    (ErrorReply(11, 2, "full"), []),
    (PutDone(12), []),
    (PutManyDone(13), []),
    (LookupResult(14, 3, (1, 2, 2, 1)), []),
]


def _stream(sender: NativeConnection, items: Sequence[tuple[Event, list[bytes]]]) -> bytes:
    return b"".join(sender.send(event, payload) for event, payload in items)


def _drain(conn: NativeConnection) -> list[Item]:
    out: list[Item] = []
    while True:
        item = conn.next_event()
        if item is NEED_DATA:
            return out
        assert not isinstance(item, type(NEED_DATA))
        if isinstance(item, PayloadEnd) and item.data is not None:
            item = PayloadEnd(item.request_id, memoryview(bytes(item.data)))
        out.append(item)
        if isinstance(item, ConnectionClosed):
            return out


def _normal(items: list[Item]) -> list[object]:
    """Events with payload memory turned into bytes, for comparison."""
    return [
        (i.request_id, bytes(i.data)) if isinstance(i, PayloadEnd) and i.data else i for i in items
    ]


def _feed(conn: NativeConnection, data: bytes, cuts: Sequence[int]) -> list[Item]:
    out: list[Item] = []
    prev = 0
    for cut in [*sorted(cuts), len(data)]:
        conn.receive_data(data[prev:cut])  # an empty chunk here would mean EOF: skipped below
        prev = cut
        out += _drain(conn)
    return out


def _expected(items: Sequence[tuple[Event, list[bytes]]]) -> list[object]:
    out: list[object] = []
    for event, payload in items:
        out.append(event)
        if event.payload_length:
            out.append((event.request_id, b"".join(payload)))
    return out


def test_every_event_has_a_frame_type_of_its_own() -> None:
    # Two events of one direction on one frame type: the parser would take one for the other.
    # (Repair and Auth were both given 14 by work done side by side.)
    seen: dict[tuple[int, bool], str] = {}
    for cls in set(native_events._ALL):  # an answer may serve two requests (Welcome)
        frame = (cls.OP, cls.RESPONSE)
        assert frame not in seen, f"{cls.__name__} and {seen[frame]} share frame type {frame}"
        seen[frame] = cls.__name__
    assert {"Repair", "Auth", "Challenge", "Hello", "ErrorReply"} <= set(seen.values())


def test_a_whole_session_round_trips() -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    server.receive_data(_stream(client, REQUESTS))
    assert _normal(_drain(server)) == _expected(REQUESTS)
    assert server.pending == len(REQUESTS) and client.pending == len(REQUESTS)
    client.receive_data(_stream(server, ANSWERS))
    assert _normal(_drain(client)) == _expected(ANSWERS)
    assert client.pending == 0 and server.pending == 0 and client.idle


def test_byte_at_a_time_gives_the_same_events() -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    data = _stream(client, REQUESTS)
    events = _feed(server, data, range(1, len(data)))
    assert _normal(events) == _expected(REQUESTS)


@given(st.lists(st.integers(min_value=1, max_value=400), max_size=30))
def test_any_chunking_gives_the_same_events(cuts: list[int]) -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    data = _stream(client, REQUESTS)
    cuts = sorted({c for c in cuts if c < len(data)})
    assert _normal(_feed(server, data, cuts)) == _expected(REQUESTS)


def test_payload_goes_straight_into_the_sink() -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    server.receive_data(client.send(Hello(1)))
    assert isinstance(server.next_event(), Hello)
    payload = bytes(range(256)) * 1024
    frame = client.send(Put(2, K1, len(payload)), [payload])
    head = len(frame) - len(payload)
    server.receive_data(frame[: head + 100])  # the head and the first 100 payload bytes
    put = server.next_event()
    assert isinstance(put, Put) and put.length == len(payload)
    first, second = bytearray(1000), bytearray(len(payload) - 1000)
    server.set_payload_sink([memoryview(first), memoryview(second)])
    assert server.next_event() is NEED_DATA
    # From now on the receive buffer *is* the sink: what the socket writes lands in place.
    pos = head + 100
    while pos < len(frame):
        dst = server.get_buffer()
        n = min(len(dst), 777, len(frame) - pos)
        dst[:n] = frame[pos : pos + n]
        server.buffer_updated(n)
        pos += n
    end = server.next_event()
    assert end == PayloadEnd(2, None)
    assert bytes(first) + bytes(second) == payload


def test_sink_memory_is_handed_out_directly() -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    server.receive_data(client.send(Hello(1)) + client.send(Put(2, K1, 10), [bytes(10)])[:-10])
    _drain_until_put(server)
    sink = bytearray(10)
    server.set_payload_sink([memoryview(sink)])
    view = server.get_buffer()
    assert len(view) == 10
    view[:] = b"x" * 10
    assert sink == b"x" * 10


def test_a_discarded_payload_is_skipped() -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    data = (
        client.send(Hello(1))
        + client.send(Put(2, K1, 70000), [bytes(70000)])
        + client.send(Get(3, K1))
    )
    server.receive_data(data[:200])
    assert isinstance(server.next_event(), Hello)
    assert isinstance(server.next_event(), Put)
    server.discard_payload()
    server.receive_data(data[200:])
    assert _drain(server) == [PayloadEnd(2, None), Get(3, K1)]


def test_sink_of_the_wrong_size_is_refused() -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    server.receive_data(client.send(Hello(1)) + client.send(Put(2, K1, 4), [b"abcd"]))
    _drain_until_put(server)
    with pytest.raises(LocalProtocolError):
        server.set_payload_sink([memoryview(bytearray(3))])


def _drain_until_put(conn: NativeConnection) -> None:
    while not isinstance(conn.next_event(), Put):
        pass


def test_clean_eof_and_eof_mid_frame() -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    server.receive_data(client.send(Hello(1)))
    server.receive_data(b"")
    assert _drain(server) == [Hello(1), ConnectionClosed()]
    client2, server2 = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    server2.receive_data(client2.send(Hello(1))[:-1])
    server2.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a frame"):
        server2.next_event()


@pytest.mark.parametrize(
    ("events", "match"),
    [
        ([Get(1, K1)], "before Hello"),
        ([Hello(1), Hello(2)], "second Hello"),
        ([Auth(1, N32)], "before Hello"),
        ([Hello(1), Auth(2, N32)], "without a Challenge"),
        ([Hello(1, nonce=N32), Get(2, K1)], "before Auth"),
        ([Hello(1), Get(2, K1), Get(2, K2)], "already outstanding"),
    ],
)
def test_server_refuses_out_of_order_requests(events: list[Event], match: str) -> None:
    raw = b"".join(_raw(e) for e in events)
    server = NativeConnection(Role.SERVER)
    server.receive_data(raw)
    with pytest.raises(RemoteProtocolError, match=match):
        _drain(server)
    with pytest.raises(RemoteProtocolError):  # stays broken
        server.next_event()


def _raw(event: Event, payload: Sequence[bytes] = ()) -> bytes:
    """Encode without the sender-side rules, to forge illegal sequences."""
    from kvoffload.wire.native.frames import FLAG_RESPONSE, encode_frame

    flags = FLAG_RESPONSE if event.RESPONSE else 0
    return b"".join(
        bytes(p) for p in encode_frame(event.OP, flags, event.request_id, event.meta(), payload)
    )


def test_client_refuses_answers_it_did_not_ask_for() -> None:
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(1))
    client.send(Get(2, K1))
    client.receive_data(_raw(PutDone(2)))
    with pytest.raises(RemoteProtocolError, match="answers a Get"):
        client.next_event()
    other = NativeConnection(Role.CLIENT)
    other.send(Hello(1))
    other.receive_data(_raw(PutDone(9)))
    with pytest.raises(RemoteProtocolError, match="unknown request id"):
        other.next_event()


def test_a_connection_level_error_needs_no_request() -> None:
    client = NativeConnection(Role.CLIENT)
    client.send(Hello(1))
    client.receive_data(_raw(ErrorReply(0, 4, "bye")))
    assert client.next_event() == ErrorReply(0, 4, "bye")


def test_sender_side_rules() -> None:
    client = NativeConnection(Role.CLIENT)
    with pytest.raises(LocalProtocolError, match="must be Hello"):
        client.send(Get(1, K1))
    client.send(Hello(1))
    with pytest.raises(LocalProtocolError, match="declares 5"):
        client.send(Put(2, K1, 5), [b"abc"])
    with pytest.raises(LocalProtocolError, match="cannot send"):
        client.send(PutDone(3))
    client.send(Get(4, K1))
    with pytest.raises(LocalProtocolError, match="already outstanding"):
        client.send(Get(4, K2))
    client.send_failed()
    with pytest.raises(LocalProtocolError, match="failed"):
        client.send(Get(5, K1))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Get(1, b"short"),
        lambda: Get(0, K1),
        lambda: Put(1, K1, -1),
        lambda: Put(1, K1, 1, durable=1),  # type: ignore[arg-type]
        lambda: PutMany(1, (K1,), (1, 2)),
        lambda: Lookup(1, [K1, "x"]),  # type: ignore[list-item]
        lambda: Lookup(1, (K1,), tiers=1),  # type: ignore[arg-type]
        lambda: LookupResult(1, 3, (1, 2, 2)),  # not pairs
        lambda: LookupResult(1, 3, (1, 2, 2, 2)),  # adds up to 4, not 3
        lambda: LookupResult(1, 2, (3, 2)),  # REMOTE is the client's label, not a daemon's
        lambda: LookupResult(1, 2, (1, 0, 2, 2)),  # an empty segment
        lambda: LookupResult(1, 2, (True, 2)),
        lambda: Hello(1, token="x" * 5000),
        lambda: Get(1 << 32, K1),
    ],
)
def test_events_are_validated_on_construction(make: object) -> None:
    with pytest.raises(LocalProtocolError):
        make()  # type: ignore[operator]


def test_too_many_outstanding_requests() -> None:
    limits = Limits(max_pending=3)
    server = NativeConnection(Role.SERVER, limits)
    server.receive_data(b"".join(_raw(e) for e in [Hello(1), Get(2, K1), Get(3, K1), Get(4, K1)]))
    with pytest.raises(RemoteProtocolError, match="more than 3"):
        _drain(server)


def _head(hlen: int, plen: int, ftype: int = 2, magic: bytes = MAGIC, version: int = 1) -> bytes:
    return FRAME.pack(magic, version, ftype, 0, 1, hlen, plen)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (_head(10, 1 << 60), "payload of"),
        (_head(1 << 30, 0), "frame header of"),
        (_head(1, 0, magic=b"HTTP"), "magic"),
        (_head(1, 0, version=9), "version"),
        (_head(1, 0, ftype=99) + b"\x80", "unknown frame type"),
        (_head(1, 0, ftype=1) + b"\xc1", "undecodable"),
        (_head(1, 0, ftype=1) + b"\x90", "not a map"),
    ],
)
def test_bad_frames_are_refused_before_allocating(data: bytes, match: str) -> None:
    server = NativeConnection(Role.SERVER)
    server.receive_data(data)
    with pytest.raises(RemoteProtocolError, match=match):
        server.next_event()


def test_unknown_and_missing_fields_are_refused() -> None:
    meta = msgpack.packb({"version": 1, "token": "", "client": "", "extra": 1})
    server = NativeConnection(Role.SERVER)
    server.receive_data(_head(len(meta), 0, ftype=1) + meta)
    with pytest.raises(RemoteProtocolError, match="unknown fields"):
        server.next_event()
    meta = msgpack.packb({"key": K1})  # Put without a length
    server = NativeConnection(Role.SERVER)
    server.receive_data(_raw(Hello(1)) + _head(len(meta), 0, ftype=2) + meta)
    with pytest.raises(RemoteProtocolError, match="malformed Put"):
        _drain(server)


def test_declared_payload_must_match_the_frame() -> None:
    meta = msgpack.packb({"key": K1, "length": 10, "parent": None, "durable": False})
    server = NativeConnection(Role.SERVER)
    server.receive_data(_raw(Hello(1)) + _head(len(meta), 3, ftype=2) + meta + b"abc")
    with pytest.raises(RemoteProtocolError, match="declares 10"):
        _drain(server)


def test_a_large_header_is_reassembled() -> None:
    keys = tuple(i.to_bytes(16, "little") for i in range(20000))  # ~380 KB map
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    data = client.send(Hello(1)) + client.send(Lookup(2, keys))
    events = _feed(server, data, range(1000, len(data), 7000))
    assert events == [Hello(1), Lookup(2, keys)]


@given(st.binary(max_size=300))
def test_fuzz_random_bytes_parse_or_raise_remote_protocol_error(data: bytes) -> None:
    for role in Role:
        conn = NativeConnection(role)
        try:
            conn.receive_data(data)
            conn.receive_data(b"")
            _drain(conn)
        except RemoteProtocolError:
            pass


@given(st.data())
def test_fuzz_mutated_sessions_parse_or_raise_remote_protocol_error(data: st.DataObject) -> None:
    client = NativeConnection(Role.CLIENT)
    stream = bytearray(_stream(client, REQUESTS))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(stream) - 1))
        stream[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(stream)))
    server = NativeConnection(Role.SERVER)
    try:
        server.receive_data(bytes(stream[:cut]))
        server.receive_data(b"")
        _drain(server)
    except RemoteProtocolError:
        pass


@given(st.integers(0, 2000))
def test_truncated_sessions_end_in_a_protocol_error_or_a_clean_close(cut: int) -> None:
    client = NativeConnection(Role.CLIENT)
    stream = _stream(client, REQUESTS)
    cut = min(cut, len(stream))
    server = NativeConnection(Role.SERVER)
    server.receive_data(stream[:cut])
    server.receive_data(b"")
    try:
        events = _drain(server)
    except RemoteProtocolError as exc:
        assert "middle of a frame" in str(exc)
    else:
        assert events[-1] == ConnectionClosed()


def _two_servers_after(requests: Sequence[Event]) -> tuple[NativeConnection, NativeConnection]:
    servers = (NativeConnection(Role.SERVER), NativeConnection(Role.SERVER))
    client = NativeConnection(Role.CLIENT)
    data = b"".join(client.send(e) for e in [Hello(1, token="t", client="c"), *requests])
    for server in servers:
        server.receive_data(data)
        _drain(server)
        server.send(Welcome(1, 1, "t", 1 << 20, 1 << 30))
    return servers


# Lengths at each of msgpack's integer widths and their edges.
_LENGTHS = [None, 0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32]


@pytest.mark.parametrize("length", _LENGTHS)
def test_the_fast_get_answer_is_the_same_bytes(length: int | None) -> None:
    # `send_get_result` skips the event and msgpack.packb of the map; the peer must see
    # exactly what `send_parts(GetResult(...))` would have sent, from a fresh and then a
    # cached header. The payload repeats one 1 MiB chunk, so 4 GiB cost no memory.
    fast, plain = _two_servers_after([Get(2, K1), Get(3, K1)])
    size = length or 0
    chunk = memoryview(bytes(range(256)) * 4096)
    payload = [chunk] * (size // len(chunk)) + [chunk[: size % len(chunk)]]
    for rid in (2, 3):
        got = fast.send_get_result(rid, length, payload)
        want = plain.send_parts(GetResult(rid, length), payload)
        assert bytes(got[0]) == bytes(want[0])  # the frame header and its map
        # The same memory, uncopied, in the same pieces (comparing 4 GiB of bytes would be slow).
        pieces = [(memoryview(p).obj, memoryview(p).nbytes) for p in got[1:]]
        assert pieces == [(memoryview(p).obj, memoryview(p).nbytes) for p in want[1:]]
    assert fast.pending == plain.pending == 0


def test_the_fast_get_answer_refuses_what_send_parts_refuses() -> None:
    (server, _) = _two_servers_after([Get(2, K1), Exists(3, K1)])
    with pytest.raises(LocalProtocolError, match="declares 5 payload bytes, got 4"):
        server.send_get_result(2, 5, [memoryview(b"four")])
    with pytest.raises(LocalProtocolError, match="GetResult answers a Exists"):
        server.send_get_result(3, None)
    with pytest.raises(LocalProtocolError, match="unknown request id 9"):
        server.send_get_result(9, None)
    assert server.pending == 2  # nothing was settled by the refusals
    assert server.send_get_result(2, 4, [memoryview(b"four")])[1] == b"four"


def test_the_fast_put_answer_is_the_same_bytes() -> None:
    fast, plain = _two_servers_after([Put(2, K1, 0), Put(3, K1, 0), Get(4, K1)])
    for rid in (2, 3):
        assert fast.send_put_done(rid) == plain.send_parts(PutDone(rid))
    with pytest.raises(LocalProtocolError, match="PutDone answers a Get"):
        fast.send_put_done(4)
    with pytest.raises(LocalProtocolError, match="unknown request id 2"):
        fast.send_put_done(2)


def test_the_fast_exists_answer_is_the_same_bytes() -> None:
    fast, plain = _two_servers_after([Exists(2, K1), Exists(3, K1), Get(4, K1)])
    for rid, found in ((2, True), (3, False)):
        assert fast.send_exists_result(rid, found) == plain.send_parts(ExistsResult(rid, found))
    with pytest.raises(LocalProtocolError, match="ExistsResult answers a Get"):
        fast.send_exists_result(4, True)
    with pytest.raises(LocalProtocolError, match="unknown request id 2"):
        fast.send_exists_result(2, True)


def test_challenge_response_hello_round_trip() -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    hello = Hello(1, tenant="alice", nonce=N32)
    server.receive_data(client.send(hello))
    assert server.next_event() == hello
    client.receive_data(server.send(Challenge(1, "n1", N32[::-1])))
    assert client.next_event() == Challenge(1, "n1", N32[::-1])
    with pytest.raises(LocalProtocolError, match="before Auth"):
        client.send(Get(2, K1))
    server.receive_data(client.send(Auth(2, N32)))
    assert server.next_event() == Auth(2, N32)
    welcome = Welcome(2, 5, "alice", 1, 1, proof=N32)
    client.receive_data(server.send(welcome))
    assert client.next_event() == welcome
    server.receive_data(client.send(Get(3, K1)))
    assert server.next_event() == Get(3, K1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Hello(1, token="t", nonce=N32),  # the token and a nonce: never both
        lambda: Hello(1, version=4, nonce=N32),
        lambda: Hello(1, tenant="alice"),  # a name without a nonce
        lambda: Hello(1, nonce=b"short"),
        lambda: Auth(1, b"short"),
    ],
)
def test_bad_challenge_hellos_are_refused(make: Callable[[], Event]) -> None:
    with pytest.raises(LocalProtocolError):
        make()


def test_a_plain_hello_has_no_challenge_fields() -> None:
    # A version 4 daemon refuses fields it does not know.
    assert b"nonce" not in NativeConnection(Role.CLIENT).send(Hello(1, version=4, token="t"))
    assert "proof" not in Welcome(1, 4, "", 1, 1).meta()
