"""Protocol 3's NIXL messages in the native codec, without sockets (issue 16)."""

from __future__ import annotations

import dataclasses

import pytest

from kvoffload.client_sdk.transports.native.options import NativeOptions
from kvoffload.client_sdk.url import parse_url
from kvoffload.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from kvoffload.wire.native.connection import (
    NIXL_DEADLINE_VERSION,
    NIXL_VERSION,
    PROTOCOL_VERSIONS,
    Event,
    Hello,
    NativeConnection,
    NixlGet,
    NixlGetResult,
    NixlMemory,
    NixlMemoryDone,
    NixlPut,
    NixlPutDone,
    Role,
    Welcome,
)

K1, K2 = bytes(16), bytes(range(16))


def _pair() -> tuple[NativeConnection, NativeConnection]:
    client, server = NativeConnection(Role.CLIENT), NativeConnection(Role.SERVER)
    server.receive_data(client.send(Hello(1, version=NIXL_VERSION)))
    assert isinstance(server.next_event(), Hello)
    client.receive_data(server.send(Welcome(1, NIXL_VERSION, "", 1 << 20, 1 << 20)))
    assert isinstance(client.next_event(), Welcome)
    return client, server


@pytest.mark.parametrize(
    ("request_", "answer"),
    [
        (NixlMemory(2, b"agent metadata", (0x1000, 4096), (0x9000, 64)), NixlMemoryDone(2)),
        (NixlMemory(2, revoke=(0x1000, 4096)), NixlMemoryDone(2)),
        (
            NixlGet(2, (K1, K2), (0x1000, 0x2000), (4096, 4096)),
            NixlGetResult(2, (None, 196), (b"h" * 96,)),
        ),
        (
            NixlPut(2, (K1, K2), (b"a" * 96, b"b" * 96), (0x1000, 0), (100, 0), (None, K1), True),
            NixlPutDone(2),
        ),
    ],
)
def test_requests_and_answers_round_trip_byte_by_byte(request_: Event, answer: Event) -> None:
    client, server = _pair()
    for data in client.send(request_):  # one byte at a time: the same event
        server.receive_data(bytes([data]))
    assert server.next_event() == request_
    for data in server.send(answer):
        client.receive_data(bytes([data]))
    assert client.next_event() == answer


@pytest.mark.parametrize(
    "make",
    [
        lambda: NixlMemory(2, b"", (1,)),  # half a region
        lambda: NixlMemory(2, b"x" * ((1 << 20) + 1)),  # metadata past the bound
        lambda: NixlGet(2, (K1,), (1, 2), (3,)),  # an address too many
        lambda: NixlGet(2, (K1,), (-1,), (3,)),  # not an address
        lambda: NixlGetResult(2, (5, None), ()),  # a hit without its header
        lambda: NixlPut(2, (K1,), (b"h",), (1,), ()),  # a length short
        lambda: NixlPut(2, (K1,), (b"h",), (1,), (2,), (None, None)),  # a parent too many
    ],
)
def test_malformed_messages_are_refused(make: object) -> None:
    with pytest.raises(LocalProtocolError):
        make()  # type: ignore[operator]


def test_a_malformed_message_from_the_peer_breaks_the_connection() -> None:
    client, server = _pair()
    frame = bytearray(client.send(NixlGet(2, (K1,), (1,), (2,))))
    frame[frame.index(b"caps") : frame.index(b"caps") + 4] = b"capz"  # an unknown field
    server.receive_data(bytes(frame))
    with pytest.raises(RemoteProtocolError, match="unknown fields"):
        server.next_event()


def test_older_peers_are_still_spoken_to() -> None:
    assert PROTOCOL_VERSIONS == (1, 2, 3, 4, 5) and NIXL_VERSION == 3
    assert NIXL_DEADLINE_VERSION == 4
    # A version 2 Welcome still carries the shard fields; version 1 still lacks them.
    assert "shard" in Welcome(1, 2, "", 1, 1).meta()
    assert "shard" not in Welcome(1, 1, "", 1, 1).meta()


@pytest.mark.parametrize(
    "request_",
    [
        NixlGet(2, (K1,), (0x1000,), (4096,), budget_ms=250),
        NixlPut(2, (K1,), (b"a" * 96,), (0x1000,), (100,), budget_ms=0),
    ],
)
def test_the_deadline_budget_travels_only_when_set(request_: NixlGet | NixlPut) -> None:
    client, server = _pair()
    sent = client.send(request_)
    server.receive_data(sent)
    assert server.next_event() == request_
    # Without a budget the frame is what a version 3 daemon knows: no budget_ms field at all.
    bare = dataclasses.replace(request_, request_id=3, budget_ms=None)
    assert b"budget_ms" in sent and b"budget_ms" not in client.send(bare)


def test_a_budget_that_is_not_a_count_of_ms_is_refused() -> None:
    with pytest.raises(LocalProtocolError):
        NixlGet(2, (K1,), (1,), (2,), budget_ms=-1)


def test_the_data_parameter_of_a_kv_url() -> None:
    assert NativeOptions.from_url(parse_url("kv://h:1?data=nixl")).data == "nixl"
    assert NativeOptions.from_url(parse_url("kv://h:1")).data == "kv"
    with pytest.raises(ConfigError, match="data must be one of"):
        NativeOptions.from_url(parse_url("kv://h:1?data=rdma"))
