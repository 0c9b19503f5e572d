"""Protocol 5's cluster requests (Repair, Describe, DeleteMany) round-trip, byte by byte, and
malformed ones are refused."""

from __future__ import annotations

import pytest

from kvoffload.errors import LocalProtocolError
from kvoffload.wire.blockmeta import BlockMeta
from kvoffload.wire.native.connection import (
    REPAIR_HOLD_S,
    REPAIR_MAX_AGE_S,
    REPAIR_VERSION,
    TOMBSTONE_RETENTION_S,
    DeleteMany,
    DeleteManyResult,
    Describe,
    Described,
    Event,
    Hello,
    NativeConnection,
    Repair,
    RepairDone,
    Role,
    Welcome,
)

K1, K2 = bytes(16), bytes(range(16))
META = BlockMeta(token_ids=(1, 2, 3), block_hash=7).encode()


def _pair() -> tuple[NativeConnection, NativeConnection]:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    server.receive_data(client.send(Hello(1, version=REPAIR_VERSION)))
    assert isinstance(server.next_event(), Hello)
    client.receive_data(server.send(Welcome(1, REPAIR_VERSION, "", 1 << 20, 1 << 20)))
    assert isinstance(client.next_event(), Welcome)
    return client, server


@pytest.mark.parametrize(
    ("request_", "payload", "answer"),
    [
        (Repair(2, K1, 5, K2, META), b"value", RepairDone(2, True)),
        (Repair(2, K1, 0), b"", RepairDone(2, False)),
        (Describe(2, K1), b"", Described(2, True, K2, META)),
        (Describe(2, K1), b"", Described(2, False)),
        (DeleteMany(2, (K1, K2)), b"", DeleteManyResult(2, (True, False))),
    ],
)
def test_requests_and_answers_round_trip_byte_by_byte(
    request_: Event, payload: bytes, answer: Event
) -> None:
    client, server = _pair()
    for data in client.send(request_, [payload] if payload else []):
        server.receive_data(bytes([data]))
    assert server.next_event() == request_
    if payload:
        server.set_payload_sink([memoryview(bytearray(len(payload)))])
        server.next_event()  # PayloadEnd
    for data in server.send(answer):
        client.receive_data(bytes([data]))
    assert client.next_event() == answer


@pytest.mark.parametrize(
    "make",
    [
        lambda: Repair(2, b"short", 1),  # not a 16-byte key
        lambda: Repair(2, K1, -1),  # not a length
        lambda: DeleteMany(2, (K1, b"x")),
        lambda: DeleteManyResult(2, (True, 3)),  # type: ignore[arg-type]
    ],
)
def test_malformed_messages_are_refused(make: object) -> None:
    with pytest.raises(LocalProtocolError):
        make()  # type: ignore[operator]


def test_a_repair_is_always_sent_well_inside_the_windows_that_refuse_it() -> None:
    # A repair older than REPAIR_MAX_AGE_S is dropped by the client; a node refuses repairs
    # for REPAIR_HOLD_S after dropping its blocks, and after a delete for the retention.
    assert REPAIR_MAX_AGE_S * 2 < REPAIR_HOLD_S < TOMBSTONE_RETENTION_S
