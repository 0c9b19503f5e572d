"""The C fast path (`_speedups`) against its pure-Python twin (kvoffload/wire/fast.py): the
same checksums, the same events from the same bytes, the same errors, the same answer bytes."""

from __future__ import annotations

import os
import socket
import struct
import types
from collections.abc import Iterator

import crc32c as reference
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import RemoteProtocolError
from kvoffload.wire import fast
from kvoffload.wire.native.connection import (
    Event,
    Exists,
    ExistsResult,
    Get,
    GetMany,
    GetManyResult,
    GetResult,
    Hello,
    Limits,
    NativeConnection,
    Put,
    PutDone,
    Role,
)
from kvoffload.wire.native.frames import FLAG_RESPONSE, FRAME, MAGIC, VERSION, encode_frame

IMPLS = fast.available()


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    previous = fast.use(request.param)
    yield request.param
    fast.use(previous)


def test_the_extension_built_where_ci_needs_it() -> None:
    # CI (CI=true) and KVOFFLOAD_REQUIRE_EXT=1 runs prove that `pip install` built it; a
    # KVOFFLOAD_PURE_PYTHON=1 run proves the fallback works without it.
    if os.environ.get("KVOFFLOAD_PURE_PYTHON") == "1":
        assert fast.IMPLEMENTATION == "python" and fast.parse_frame is None
    elif os.environ.get("CI") == "true" or os.environ.get("KVOFFLOAD_REQUIRE_EXT") == "1":
        assert "c" in IMPLS and fast.IMPLEMENTATION == "c"


# ---------------------------------------------------------------------------- CRC32C


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=4096 + 16),
    offset=st.integers(0, 15),
    seed=st.integers(0, 2**32 - 1),
)
def test_crc32c_matches_the_crc32c_package(data: bytes, offset: int, seed: int) -> None:
    view = memoryview(data)[offset:]  # unaligned starts
    for name in IMPLS:
        fast.use(name)
        assert fast.crc32c(view, seed) == reference.crc32c(view, seed)
        dst = bytearray(len(view) + offset + 3)
        target = memoryview(dst)[offset:]
        assert fast.crc32c_copy(target, view, seed) == reference.crc32c(view, seed)
        assert bytes(target[: len(view)]) == bytes(view)
        assert not any(dst[:offset]) and not any(target[len(view) :])


# Every loop the extension has (table, SSE4.2 `crc32`, VPCLMULQDQ folding with `crc32` streams,
# VPCLMULQDQ at AVX-512 width),
# across the sizes where it switches: 256 (folding starts), 8704 (a hybrid block) and more.
LOOPS = (0, 1, 2, 3)
_BLOCK = 8704


@pytest.fixture(scope="module")
def ext_loops() -> Iterator[object]:
    if "c" not in IMPLS:
        pytest.skip("the C extension is not built here")
    from kvoffload.wire import _speedups

    yield _speedups
    _speedups.crc_level(3)


@settings(max_examples=200, deadline=None)
@given(
    size=st.one_of(
        st.integers(0, 600),
        st.integers(_BLOCK - 300, _BLOCK + 300),
        st.integers(2 * _BLOCK - 130, 2 * _BLOCK + 130),
        st.integers(0, 3 * _BLOCK + 4096),
    ),
    src_offset=st.integers(0, 63),
    dst_offset=st.integers(0, 63),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_crc_loop_matches_the_crc32c_package(
    ext_loops: object, size: int, src_offset: int, dst_offset: int, seed: int
) -> None:
    ext = ext_loops
    data = memoryview(os.urandom(size + src_offset))[src_offset:]
    want = reference.crc32c(data, seed)
    for level in LOOPS:
        ext.crc_level(level)  # type: ignore[attr-defined]
        assert ext.crc32c(data, seed) == want, level  # type: ignore[attr-defined]
        dst = bytearray(size + dst_offset + 5)
        target = memoryview(dst)[dst_offset:]
        assert ext.crc32c_copy(target, data, seed) == want, level  # type: ignore[attr-defined]
        assert bytes(target[:size]) == bytes(data)
        assert not any(dst[:dst_offset]) and not any(target[size:])


def test_the_crc_loops_are_named(ext_loops: object) -> None:
    names = [ext_loops.crc_level(level) for level in LOOPS]  # type: ignore[attr-defined]
    assert names[0] == "table" and names[1] in ("table", "sse4.2")
    assert names[2] in ("table", "sse4.2", "vpclmulqdq")
    assert names[3] in (names[2], "vpclmulqdq-512")


def test_crc32c_every_length_to_4096_and_large(impl: str) -> None:
    data = os.urandom((3 << 20) + 123)
    lengths = [*range(4097), 3 * 1024 * 7 + 5, 8704 * 3 + 255, 1 << 20, (2 << 20) + 1, len(data)]
    for n in lengths:
        assert fast.crc32c(data[:n]) == reference.crc32c(data[:n]), n
    for n in (0, 1, 3071, 3072, 3073, 9216 + 7, len(data)):
        dst = bytearray(n)
        assert fast.crc32c_copy(dst, data[:n], 5) == reference.crc32c(data[:n], 5)
        assert dst == data[:n]


def test_crc32c_copy_refuses_a_short_destination_and_bad_seeds(impl: str) -> None:
    with pytest.raises(ValueError):
        fast.crc32c_copy(bytearray(3), b"four")
    with pytest.raises(TypeError):
        fast.crc32c_copy(b"read-only", b"x")
    if impl == "c":
        with pytest.raises((ValueError, OverflowError)):
            fast.crc32c(b"x", 1 << 32)
        shared = bytearray(64)
        with pytest.raises(ValueError, match="overlap"):
            fast.crc32c_copy(memoryview(shared)[8:], memoryview(shared)[:32])


# ---------------------------------------------------------------------------- frames

K = bytes(range(16))
# Every msgpack form of an unsigned integer, as other encoders may choose them.
_UINT_FORMS = [
    (0x7F, lambda v: bytes([v]) if v < 0x80 else None),
    (0xFF, lambda v: b"\xcc" + struct.pack(">B", v) if v < 1 << 8 else None),
    (0xFFFF, lambda v: b"\xcd" + struct.pack(">H", v) if v < 1 << 16 else None),
    (0xFFFFFFFF, lambda v: b"\xce" + struct.pack(">I", v) if v < 1 << 32 else None),
    (2**64 - 1, lambda v: b"\xcf" + struct.pack(">Q", v)),
    (0x7F, lambda v: b"\xd0" + struct.pack(">b", v) if v < 1 << 7 else None),
    (0x7FFF, lambda v: b"\xd1" + struct.pack(">h", v) if v < 1 << 15 else None),
    (0x7FFFFFFF, lambda v: b"\xd2" + struct.pack(">i", v) if v < 1 << 31 else None),
    (2**63 - 1, lambda v: b"\xd3" + struct.pack(">q", v) if v < 1 << 63 else None),
]


def _frame(op: int, flags: int, rid: int, meta: bytes, plen: int) -> bytes:
    return FRAME.pack(MAGIC, VERSION, op, flags, rid, len(meta), plen) + meta


def _outcome(data: bytes, role: Role, impl: str, chunk: int = 0) -> list[object]:
    """What a connection makes of `data` (after its own Hello): events, or the error."""
    fast.use(impl)
    conn = NativeConnection(role, Limits(max_header_bytes=256, max_payload_bytes=1 << 20))
    peer = NativeConnection(Role.CLIENT if role is Role.SERVER else Role.SERVER)
    if role is Role.SERVER:
        conn.receive_data(peer.send(Hello(1)))
        assert conn.next_event() == Hello(1)
    else:
        conn.send(Hello(1))
        conn.send(Get(7, K))
        conn.send(Put(8, K, 3), [b"abc"])
        conn.send(Exists(9, K))
    out: list[object] = []
    pieces = [data] if not chunk else [data[i : i + chunk] for i in range(0, len(data), chunk)]
    try:
        for piece in pieces:
            conn.receive_data(piece)
            while (event := conn.next_event()) is not None:
                if event.__class__.__name__ == "Need":
                    break
                out.append(event)
                if isinstance(event, Event) and event.payload_length:
                    conn.discard_payload()
    except RemoteProtocolError as exc:
        out.append(f"error: {exc}")
    return out


def _same(data: bytes, role: Role, chunk: int = 0) -> list[object]:
    outcomes = [_outcome(data, role, name, chunk) for name in IMPLS]
    fast.use(IMPLS[-1])
    assert all(o == outcomes[0] for o in outcomes), outcomes
    return outcomes[0]


@pytest.mark.parametrize("width", range(len(_UINT_FORMS)))
def test_every_integer_width_decodes_alike(width: int) -> None:
    top, form = _UINT_FORMS[width]
    for value in {0, 1, 3, top, top - 1, 2**63 - 1, 2**63, 2**64 - 1}:
        packed = form(value)
        if packed is None:
            continue
        plen = value if value <= 1 << 20 else 0
        put = _frame(2, 0, 5, b"\x82\xa3key\xc4\x10" + K + b"\xa6length" + packed, plen)
        got = _same(put + bytes(min(plen, 1 << 20)), Role.SERVER)
        answer = _frame(3, FLAG_RESPONSE, 7, b"\x81\xa6length" + packed, plen)
        _same(answer + bytes(min(plen, 1 << 20)), Role.CLIENT)
        if value == 3:
            assert got[0] == Put(5, K, 3)
        if "c" in IMPLS and value <= 1 << 20:
            # the C path takes every width (the fallback would hide a gap otherwise)
            fast.use("c")
            assert fast.parse_frame is not None
            assert fast.parse_frame(bytearray(put), 0, len(put), 256, 1 << 20) is not None
            assert fast.parse_frame(bytearray(answer), 0, len(answer), 256, 1 << 20) is not None


def test_other_encodings_of_the_same_map_decode_alike() -> None:
    key_forms = [b"\xc4\x10" + K, b"\xc5\x00\x10" + K, b"\xc6\x00\x00\x00\x10" + K, b"\xc0"]
    name_forms = [b"\xa3key", b"\xd9\x03key", b"\xda\x00\x03key"]
    for key in key_forms:
        for name in name_forms:
            _same(_frame(3, 0, 2, b"\x81" + name + key, 0), Role.SERVER)
            _same(_frame(3, 0, 2, b"\xde\x00\x01" + name + key, 0), Role.SERVER)
    # a repeated field (msgpack keeps the last; C leaves it to Python)
    _same(_frame(3, 0, 2, b"\x82\xa3key\xc4\x10" + K + b"\xa3key\xc4\x10" + K, 0), Role.SERVER)
    # unknown, missing and extra fields; a payload the map does not declare
    for meta, plen in [
        (b"\x82\xa3key\xc4\x10" + K + b"\xa3bad\xc0", 0),
        (b"\x80", 0),
        (b"\x81\xa3key\xc4\x10" + K + b"\xc0", 0),
        (b"\x81\xa3key\xc4\x10" + K, 4),
    ]:
        assert "error" in str(_same(_frame(3, 0, 2, meta, plen) + bytes(plen), Role.SERVER))


def test_bad_heads_fail_alike() -> None:
    get = b"\x81\xa3key\xc4\x10" + K
    good = _frame(3, 0, 2, get, 0)
    for bad in [
        b"KVNX" + good[4:],
        good[:4] + b"\x02" + good[5:],
        good[:6] + b"\x04\x00" + good[8:],
        _frame(3, 0, 0, get, 0),
        _frame(3, 0, 2, get + b"\x00" * 300, 0),
        _frame(3, 0, 2, get, 2 << 20),
        _frame(3, FLAG_RESPONSE, 2, get, 0),
        _frame(99, 0, 2, get, 0),
    ]:
        assert "error" in str(_same(bad, Role.SERVER))


# request id 1 is the Hello's, outstanding on the server side
events = st.one_of(
    st.builds(Get, st.integers(2, 2**32 - 1), st.binary(min_size=16, max_size=16)),
    st.builds(Exists, st.integers(2, 2**32 - 1), st.binary(min_size=16, max_size=16)),
    st.builds(
        Put,
        st.integers(2, 2**32 - 1),
        st.binary(min_size=16, max_size=16),
        st.integers(0, 300),
        st.none() | st.binary(min_size=16, max_size=16),
        st.booleans(),
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    sent=st.lists(events, min_size=1, max_size=4, unique_by=lambda e: e.request_id),
    cut=st.integers(0, 40),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=3),
    chunk=st.sampled_from([0, 1, 7]),
)
def test_requests_and_damaged_requests_decode_alike(
    sent: list[Event], cut: int, flips: list[tuple[int, int]], chunk: int
) -> None:
    data = b"".join(
        b"".join(encode_frame(e.OP, 0, e.request_id, e.meta(), [bytes(e.payload_length)]))
        for e in sent
    )
    damaged = bytearray(data[: len(data) - cut] if cut < len(data) else data)
    for at, xor in flips:
        if damaged:
            damaged[at % len(damaged)] ^= xor
    got = _same(bytes(data), Role.SERVER, chunk)
    assert [g for g in got if isinstance(g, Event)] == sent
    _same(bytes(damaged), Role.SERVER, chunk)


@settings(max_examples=100, deadline=None)
@given(length=st.none() | st.integers(0, 2**63 - 1), found=st.booleans())
def test_answers_decode_alike(length: int | None, found: bool) -> None:
    plen = length if length is not None and length <= 1 << 20 else None
    answer = encode_frame(3, FLAG_RESPONSE, 7, {"length": plen}, [bytes(plen or 0)])
    assert _same(b"".join(answer), Role.CLIENT)[0] == GetResult(7, plen)
    wrong = encode_frame(3, FLAG_RESPONSE, 7, {"length": length}, [])
    _same(b"".join(wrong), Role.CLIENT)
    assert _same(b"".join(encode_frame(4, FLAG_RESPONSE, 9, {"found": found})), Role.CLIENT) == [
        ExistsResult(9, found)
    ]
    assert _same(b"".join(encode_frame(2, FLAG_RESPONSE, 8, {})), Role.CLIENT) == [PutDone(8)]


@settings(max_examples=200, deadline=None)
@given(
    rid=st.integers(1, 2**32 - 1),
    value=st.none() | st.booleans() | st.integers(0, 2**64 - 1),
    plen=st.integers(0, 2**64 - 1),
)
def test_answer_heads_are_byte_identical(rid: int, value: object, plen: int) -> None:
    want = FRAME.pack(MAGIC, VERSION, 3, FLAG_RESPONSE, rid, 0, plen)
    packed = msgpack.packb({"length": value}, use_bin_type=True)
    want = FRAME.pack(MAGIC, VERSION, 3, FLAG_RESPONSE, rid, len(packed), plen) + packed
    empty = FRAME.pack(MAGIC, VERSION, 2, FLAG_RESPONSE, rid, 1, 0) + b"\x80"
    for name in IMPLS:
        fast.use(name)
        assert fast.frame_head(3, rid, "length", value, plen) == want
        assert fast.frame_head(2, rid, None, None, 0) == empty


@pytest.mark.parametrize("rid, plen", [(2**32, 0), (2**64 + 5, 0), (-1, 0), (1, -1), (1, 2**64)])
def test_answer_heads_refuse_what_does_not_fit(impl: str, rid: int, plen: int) -> None:
    # Both implementations refuse, rather than wrap, a request id or length out of range.
    with pytest.raises((OverflowError, ValueError, struct.error)):
        fast.frame_head(3, rid, "length", 1, plen)


# ---------------------------------------------------------------------------- one-call exchanges


@pytest.mark.skipif("c" not in IMPLS, reason="the C extension is not built here")
@pytest.mark.parametrize("rid", [1, 300, 0xFFFF_FFFF])
def test_the_get_frame_c_builds_is_the_python_codecs(rid: int) -> None:
    from kvoffload.wire import _speedups

    key = bytes(range(16))
    client, daemon = socket.socketpair()
    with client, daemon:
        # The answer waits in the socket: a miss for `rid`, then a byte of the next frame.
        answer = b"".join(encode_frame(3, FLAG_RESPONSE, rid, {"length": None})) + b"K"
        daemon.sendall(answer)
        got = _speedups.net_get_into(client.fileno(), key, rid, bytearray(96), bytearray(8), 5.0)
        sent = daemon.recv(1024)
    assert sent == b"".join(encode_frame(3, 0, rid, Get(rid, key).meta()))
    assert got == (fast.NET_DONE, -1, 0xFFFF_FFFF ^ 0xFFFF_FFFF, 0, b"K")


@pytest.mark.skipif("c" not in IMPLS, reason="the C extension is not built here")
def test_an_answer_c_does_not_take_comes_back_whole() -> None:
    from kvoffload.wire import _speedups

    client, daemon = socket.socketpair()
    with client, daemon:
        answer = b"".join(encode_frame(3, FLAG_RESPONSE, 9, {"length": 5, "x": 1}, [b"abcde"]))
        daemon.sendall(answer)
        daemon.shutdown(socket.SHUT_WR)
        got = _speedups.net_get_into(
            client.fileno(), b"k" * 16, 9, bytearray(96), bytearray(8), 5.0
        )
    status, _, _, eof, data = got
    assert status == fast.NET_FALLBACK and answer.startswith(data) and len(data) >= 24


@pytest.mark.skipif("c" not in IMPLS, reason="the C extension is not built here")
def test_bad_request_ids_are_refused_before_anything_is_sent() -> None:
    from kvoffload.wire import _speedups

    client, daemon = socket.socketpair()
    with client, daemon:
        for rid in (0, 1 << 32):
            with pytest.raises(ValueError, match="request id"):
                _speedups.net_get_into(
                    client.fileno(), b"k" * 16, rid, bytearray(96), bytearray(), 1.0
                )
        daemon.setblocking(False)
        with pytest.raises(BlockingIOError):
            daemon.recv(1)  # nothing went out


@pytest.mark.skipif("c" not in IMPLS, reason="the C extension is not built here")
def test_no_exchange_takes_an_answer_for_request_id_zero() -> None:
    # Found by an input of the net-put and net-get-many-into fuzz targets (now a seed of
    # each): request id 0 is the connection's own (its ErrorReply is a goodbye) and the codec
    # refuses any other answer for it, but net_put and net_get_many_into took a PutDone /
    # GetManyResult numbered 0.
    from kvoffload.wire import _speedups

    answers = {
        "put": b"".join(encode_frame(PutDone.OP, FLAG_RESPONSE, 0, {})),
        "many": b"".join(encode_frame(GetManyResult.OP, FLAG_RESPONSE, 0, {"lengths": [None]})),
    }
    for kind, answer in answers.items():
        client, daemon = socket.socketpair()
        with client, daemon:
            daemon.sendall(answer)
            client.setblocking(False)
            with pytest.raises(ValueError, match="request id"):
                if kind == "put":
                    frame = encode_frame(Put.OP, 0, 0, Put(1, b"k" * 16, 1).meta(), [b"x"])
                    _speedups.net_put(client.fileno(), frame, 0, PutDone.OP, 5.0)
                else:
                    frame = encode_frame(GetMany.OP, 0, 0, GetMany(1, (b"k" * 16,)).meta())
                    _speedups.net_get_many_into(
                        client.fileno(), b"".join(frame), 0, [bytearray(96)], [bytearray(8)], 5.0
                    )
            daemon.setblocking(False)
            with pytest.raises(BlockingIOError):
                daemon.recv(1)  # nothing went out


@pytest.mark.skipif("c" not in IMPLS, reason="the C extension is not built here")
@pytest.mark.parametrize("call", ["get_into", "get_many_into", "put"])
def test_a_nan_timeout_is_refused_before_anything_is_sent(call: str) -> None:
    # A NaN deadline never compares as passed and turns into a negative poll() timeout: a
    # stalled daemon would hold the call forever. Here the answer is already waiting, so the
    # unchecked call returns it instead of refusing.
    from kvoffload.wire import _speedups

    key = b"k" * 16
    client, daemon = socket.socketpair()
    with client, daemon:
        client.setblocking(False)
        nan = float("nan")
        with pytest.raises(ValueError, match="timeout"):
            if call == "get_into":
                daemon.sendall(b"".join(encode_frame(3, FLAG_RESPONSE, 5, {"length": None})))
                _speedups.net_get_into(client.fileno(), key, 5, bytearray(96), bytearray(8), nan)
            elif call == "get_many_into":
                daemon.sendall(
                    b"".join(encode_frame(GetMany.OP, FLAG_RESPONSE, 5, {"lengths": [None]}))
                )
                frame = b"".join(encode_frame(GetMany.OP, 0, 5, GetMany(5, (key,)).meta()))
                _speedups.net_get_many_into(
                    client.fileno(), frame, 5, [bytearray(96)], [bytearray(8)], nan
                )
            else:
                daemon.sendall(b"".join(encode_frame(PutDone.OP, FLAG_RESPONSE, 5, {})))
                parts = encode_frame(Put.OP, 0, 5, Put(5, key, 1).meta(), [b"x"])
                _speedups.net_put(client.fileno(), parts, 5, PutDone.OP, nan)
        daemon.setblocking(False)
        with pytest.raises(BlockingIOError):
            daemon.recv(1)  # nothing went out


@pytest.mark.skipif("c" not in IMPLS, reason="the C extension is not built here")
@pytest.mark.parametrize("call", ["get_into", "get_many_into", "put"])
@pytest.mark.parametrize("rid", [(1 << 64) + 5, -(1 << 64) + 5, -5])
def test_a_request_id_out_of_range_is_refused_not_wrapped(call: str, rid: int) -> None:
    # Found while writing the net-* fuzz targets (their ids now wrap so): the request id was
    # parsed modulo 2**64, so 2**64 + 5 sent (or matched) request 5 and took its answer,
    # which waits here.
    from kvoffload.wire import _speedups

    key = b"k" * 16
    answers = {
        "get_into": encode_frame(GetResult.OP, FLAG_RESPONSE, 5, {"length": None}),
        "get_many_into": encode_frame(GetMany.OP, FLAG_RESPONSE, 5, {"lengths": [None]}),
        "put": encode_frame(PutDone.OP, FLAG_RESPONSE, 5, {}),
    }
    client, daemon = socket.socketpair()
    with client, daemon:
        client.setblocking(False)
        daemon.sendall(b"".join(answers[call]))
        with pytest.raises(OverflowError):
            if call == "get_into":
                _speedups.net_get_into(client.fileno(), key, rid, bytearray(96), bytearray(8), 5.0)
            elif call == "get_many_into":
                frame = b"".join(encode_frame(GetMany.OP, 0, 5, GetMany(5, (key,)).meta()))
                _speedups.net_get_many_into(
                    client.fileno(), frame, rid, [bytearray(96)], [bytearray(8)], 5.0
                )
            else:
                parts = encode_frame(Put.OP, 0, 5, Put(5, key, 1).meta(), [b"x"])
                _speedups.net_put(client.fileno(), parts, rid, PutDone.OP, 5.0)
        daemon.setblocking(False)
        with pytest.raises(BlockingIOError):
            daemon.recv(1)  # nothing went out


def test_a_build_older_than_its_python_code_is_refused_by_name() -> None:
    """An editable install keeps the .so it built before a `git pull`: its loader must say
    that it is stale (an ImportError without a module name), not fail at first use."""
    old = types.ModuleType("kvoffload.wire._speedups")
    old.__file__ = "/old/_speedups.so"
    old.crc32c = fast.py_crc32c  # type: ignore[attr-defined]
    with pytest.raises(ImportError, match=r"lacks crc32c_copy, .*rebuild") as caught:
        fast.stale(old, fast._NAMES)
    assert caught.value.name is None


@pytest.mark.skipif(fast._EXT is None, reason="the C extension did not build")
def test_the_built_extension_has_every_name_its_python_side_takes() -> None:
    assert fast._EXT is not None
    fast.stale(fast._EXT, fast._NAMES)  # raises if this build were stale
