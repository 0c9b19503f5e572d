"""`net_lookup` (`_speedups_net.c`) against the Python codec, the reference: the Lookup frame it
builds is byte for byte `encode_frame`'s for random key lists (1, 15, 16, 1,000 and 4,096 keys,
duplicates), it takes only a canonical {"count": n} answer for its request id and hands
anything else back whole, and keys it cannot frame are refused before a byte is sent."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import msgpack
import pytest

from kvoffload.wire import fast
from kvoffload.wire.native.events import ErrorReply, Lookup
from kvoffload.wire.native.frames import FLAG_RESPONSE, FRAME, MAGIC, VERSION, encode_frame

pytestmark = pytest.mark.skipif("c" not in fast.available(), reason="the C extension is not built")

RID = 77


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    # Room for a 4,096-key frame while nobody reads it.
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    with a, b:
        yield a, b


def c_lookup() -> object:
    from kvoffload.wire import _speedups

    return _speedups.net_lookup


def answer(rid: int, meta: dict[str, object], flags: int = FLAG_RESPONSE, op: int = 8) -> bytes:
    packed = msgpack.packb(meta, use_bin_type=True)
    return FRAME.pack(MAGIC, VERSION, op, flags, rid, len(packed), 0) + packed


def sent(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    out = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return out
        out += chunk


def reference(keys: list[bytes]) -> bytes:
    event = Lookup(RID, tuple(keys))
    return b"".join(bytes(p) for p in encode_frame(event.OP, 0, RID, event.meta()))


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 255, 256, 1000, 4096])
def test_the_frame_is_the_python_codecs(pair: tuple[socket.socket, socket.socket], n: int) -> None:
    a, b = pair
    rng = random.Random(n)
    keys = [rng.randbytes(16) for _ in range(n)]
    if n > 2:  # a chain may repeat a key: it is sent as given
        keys[n // 2] = keys[0]
    b.sendall(answer(RID, {"count": n // 3}))
    status, count, eof, data = c_lookup()(a.fileno(), keys, RID, 5.0)  # type: ignore[operator]
    assert (status, count, eof, data) == (fast.NET_DONE, n // 3, 0, b"")
    assert sent(b) == reference(keys)


@pytest.mark.parametrize("count", [0, 1, 127, 128, 255, 256, 4096])
def test_every_msgpack_width_of_the_count_is_taken(
    pair: tuple[socket.socket, socket.socket], count: int
) -> None:
    a, b = pair
    b.sendall(answer(RID, {"count": count}))
    got = c_lookup()(a.fileno(), [b"k" * 16] * 4096, RID, 5.0)  # type: ignore[operator]
    assert got == (fast.NET_DONE, count, 0, b"")


def _error() -> bytes:
    e = ErrorReply(RID, 4, "no")
    packed = msgpack.packb(e.meta(), use_bin_type=True)
    return FRAME.pack(MAGIC, VERSION, e.OP, FLAG_RESPONSE, RID, len(packed), 0) + packed


BAD = {
    "tiers": answer(RID, {"count": 2, "tiers": [0, 2]}),
    "another id": answer(RID + 1, {"count": 2}),
    "not a response": answer(RID, {"count": 2}, flags=0),
    "another op": answer(RID, {"count": 2}, op=9),
    "count over 4096": answer(RID, {"count": 4097}),
    "negative count": answer(RID, {"count": -1}),
    "count as text": answer(RID, {"count": "2"}),
    "non-canonical width": FRAME.pack(MAGIC, VERSION, 8, FLAG_RESPONSE, RID, 9, 0)
    + b"\x81\xa5count\xcd\x00\x02",
    "a payload": FRAME.pack(MAGIC, VERSION, 8, FLAG_RESPONSE, RID, 8, 3) + b"\x81\xa5count\x02",
    "error reply": _error(),
    "bytes after the frame": answer(RID, {"count": 2}) + b"KVNP",
    "a map too big to read at once": answer(RID, {"count": 2, "x": b"y" * 600}),
}


@pytest.mark.parametrize("wire", list(BAD.values()), ids=list(BAD))
def test_any_other_answer_is_handed_back_whole(
    pair: tuple[socket.socket, socket.socket], wire: bytes
) -> None:
    a, b = pair
    b.sendall(wire)
    b.shutdown(socket.SHUT_WR)
    status, count, _eof, data = c_lookup()(a.fileno(), [b"k" * 16] * 3, RID, 5.0)  # type: ignore[operator]
    assert (status, count) == (fast.NET_FALLBACK, 0)
    assert wire.startswith(data) and len(data) == min(len(wire), 512)


def test_a_cut_answer_is_handed_back_with_eof(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    wire = answer(RID, {"count": 2})
    b.sendall(wire[:-3])
    b.shutdown(socket.SHUT_WR)
    got = c_lookup()(a.fileno(), [b"k" * 16] * 3, RID, 5.0)  # type: ignore[operator]
    assert got == (fast.NET_FALLBACK, 0, 1, wire[:-3])


BAD_KEYS = {
    "none": ([], ValueError),
    "over 4096": ([b"k" * 16] * 4097, ValueError),
    "a short key": ([b"k" * 16, b"k" * 15], TypeError),
    "a str key": ([b"k" * 16, "k" * 16], TypeError),
    "a bytearray key": ([bytearray(16)], TypeError),
    "not a list": (iter([b"k" * 16]), TypeError),
}


@pytest.mark.parametrize("keys, error", list(BAD_KEYS.values()), ids=list(BAD_KEYS))
def test_keys_it_cannot_frame_are_refused_before_sending(
    pair: tuple[socket.socket, socket.socket], keys: object, error: type[Exception]
) -> None:
    a, b = pair
    with pytest.raises(error):
        c_lookup()(a.fileno(), keys, RID, 5.0)  # type: ignore[operator]
    assert sent(b) == b""


@pytest.mark.parametrize("rid", [0, 1 << 32])
def test_a_request_id_the_codec_could_not_number_is_refused(
    pair: tuple[socket.socket, socket.socket], rid: int
) -> None:
    with pytest.raises(ValueError):
        c_lookup()(pair[0].fileno(), [b"k" * 16], rid, 5.0)  # type: ignore[operator]


def test_no_answer_by_the_deadline_is_a_timeout(pair: tuple[socket.socket, socket.socket]) -> None:
    pair[0].settimeout(5.0)  # non-blocking, as the client arms it: C polls to the deadline
    with pytest.raises(TimeoutError):
        c_lookup()(pair[0].fileno(), [b"k" * 16], RID, 0.05)  # type: ignore[operator]


@pytest.mark.parametrize("seed", range(20))
def test_all_keys_agrees_with_the_python_check(seed: int) -> None:
    from kvoffload.wire import _speedups

    rng = random.Random(seed)
    pool: list[object] = [b"k" * 16, b"k" * 15, b"k" * 17, bytearray(16), "k" * 16, None, 16]
    for _ in range(50):
        n = rng.choice([0, 1, 2, 1000])
        items = [b"k" * 16] * n
        if n and rng.random() < 0.7:
            items[rng.randrange(n)] = rng.choice(pool)  # type: ignore[call-overload]
        for seq in (items, tuple(items)):
            assert _speedups.all_keys(seq, 16) == fast.py_all_keys(seq, 16)
    for other in (iter([b"k" * 16]), type("Keys", (list,), {})([b"k" * 16]), b"k" * 16):
        assert _speedups.all_keys(other, 16) is fast.py_all_keys(other, 16) is False
