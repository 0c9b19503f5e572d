"""The native codec hands a payload over piece by piece (`set_payload_part` / `SinkFull`), so
that a server reserves memory for one value of a batch at a time."""

from __future__ import annotations

from kvoffload.wire.native.connection import (
    NEED_DATA,
    Hello,
    NativeConnection,
    PayloadEnd,
    Put,
    Role,
    SinkFull,
)


def test_codec_delivers_a_payload_piece_by_piece() -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    stream = client.send(Hello(1)) + client.send(Put(2, bytes(16), 10), [b"0123456789"])
    first, second = bytearray(4), bytearray(6)
    seen: list[object] = []
    for byte in stream:  # byte at a time: the same events as in one piece
        server.receive_data(bytes([byte]))
        while (event := server.next_event()) is not NEED_DATA:
            seen.append(event)
            if isinstance(event, Put):
                server.set_payload_part([memoryview(first)])
            elif isinstance(event, SinkFull):
                server.set_payload_part([memoryview(second)])
    assert seen[1:] == [Put(2, bytes(16), 10), SinkFull(2, 6), PayloadEnd(2, None)]
    assert bytes(first + second) == b"0123456789"


def test_a_sink_full_left_alone_lets_the_codec_allocate_the_rest() -> None:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    server.receive_data(client.send(Hello(1)) + client.send(Put(2, bytes(16), 10), [b"0123456789"]))
    assert isinstance(server.next_event(), Hello)
    assert isinstance(server.next_event(), Put)
    first = bytearray(4)
    server.set_payload_part([memoryview(first)])
    assert server.next_event() == SinkFull(2, 6)
    end = server.next_event()
    assert isinstance(end, PayloadEnd) and end.data is not None and bytes(end.data) == b"456789"
    assert bytes(first) == b"0123"
