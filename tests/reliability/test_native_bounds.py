"""The native codec's receive side allocates no more than what arrived, whatever a frame
declares (found by the fuzz harnesses in fuzz_codecs.py and the live fuzzer, bench/fuzz/)."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from collections.abc import Iterator

import msgpack
import pytest

from kvoffload.errors import RemoteProtocolError
from kvoffload.wire.native.connection import (
    NEED_DATA,
    GetMany,
    Hello,
    Limits,
    NativeConnection,
    Role,
)
from kvoffload.wire.native.frames import FRAME, MAGIC, VERSION

LIMITS = Limits(max_header_bytes=4 << 20)
KEY = bytes(range(16))


def _ready_server() -> NativeConnection:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER, LIMITS)
    server.receive_data(client.send(Hello(1)))
    assert isinstance(server.next_event(), Hello)
    return server


def _frame(rid: int, header: bytes) -> bytes:
    return FRAME.pack(MAGIC, VERSION, GetMany.OP, 0, rid, len(header), 0) + header


@contextlib.contextmanager
def _peak() -> Iterator[list[int]]:
    """The peak of Python allocations inside the block, in bytes (read after it)."""
    out: list[int] = []
    tracemalloc.start()
    try:
        yield out
    finally:
        out.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def test_a_declared_header_costs_nothing_until_its_bytes_arrive() -> None:
    server = _ready_server()
    header = msgpack.packb({"keys": [KEY] * 200_000})  # a real 3.6 MiB GetMany header
    frame = _frame(2, header)
    with _peak() as peak:
        server.receive_data(frame[: FRAME.size + 10])
        assert server.next_event() is NEED_DATA
        server.get_buffer()
    assert peak[0] < 1 << 20, f"{peak[0]} bytes allocated for 34 bytes received"
    # The rest arrives in pieces and the frame still parses.
    rest = frame[FRAME.size + 10 :]
    for i in range(0, len(rest), 100_000):
        server.receive_data(rest[i : i + 100_000])
    event = server.next_event()
    assert isinstance(event, GetMany) and len(event.keys) == 200_000


@pytest.mark.parametrize("empty", [b"\x90", b"\x80"], ids=["lists", "maps"])
def test_a_header_of_empty_containers_is_refused_without_building_them(empty: bytes) -> None:
    server = _ready_server()
    n = LIMITS.max_header_bytes - 16
    header = b"\x81\xa4keys\xdd" + struct.pack(">I", n) + empty * n
    server.receive_data(_frame(2, header))
    with _peak() as peak, pytest.raises(RemoteProtocolError, match="lists and maps"):
        server.next_event()
    assert peak[0] < 32 << 20, f"{peak[0] >> 20} MiB to decode a {len(header) >> 20} MiB header"


def test_msgpack_extension_types_are_refused() -> None:
    server = _ready_server()
    server.receive_data(_frame(2, b"\x81\xa4keys\x91\xd4\x05\x00"))
    with pytest.raises(RemoteProtocolError, match="extension type 5"):
        server.next_event()


def test_unknown_field_names_are_quoted_short() -> None:
    """The names come from the peer and the message is logged and sent back: a header of
    thousands of long field names must not become a megabyte log line."""
    server = _ready_server()
    header = msgpack.packb({f"{i:06d}" + "x" * 200: 0 for i in range(10_000)})
    server.receive_data(_frame(2, header))
    with pytest.raises(RemoteProtocolError, match="unknown fields") as caught:
        server.next_event()
    message = str(caught.value)
    assert len(message) < 500, f"a {len(message)}-character error message"
    assert "000000" in message and "9997 more" in message
