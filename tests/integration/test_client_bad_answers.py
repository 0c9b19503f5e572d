"""The `kv://` client against a peer that breaks the protocol in ways the codec alone cannot
see (an answer that does not fit its request: RemoteProtocolError, a KVOffloadError) or stops
in the middle of an answer (no partial block is left in a `get_into` buffer).

The real daemon never sends these, so the peer here is a scripted server on 127.0.0.1 built on
the same sans-I/O codec.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from kvoffload.client_sdk import AsyncClient, Client
from kvoffload.errors import KVOffloadError, RemoteProtocolError, TransportError
from kvoffload.wire.block import HEADER_BYTES
from kvoffload.wire.blockmeta import BlockMeta
from kvoffload.wire.native.connection import (
    NEED_DATA,
    ConnectionClosed,
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
    Put,
    PutDone,
    PutMany,
    PutManyDone,
    Role,
    Welcome,
)
from kvoffload.wire.status import Status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# request -> (bytes to send, then close the connection)
Answer = Callable[[NativeConnection, Event], tuple[bytes, bool]]


@contextlib.contextmanager
def peer(answer: Answer, speaks: tuple[int, ...] = (1, 2)) -> Iterator[int]:
    """A native-protocol server that welcomes every connection and answers every other request
    with `answer`; yields its port. It refuses a Hello of a version outside `speaks` as a
    daemon of that age does (an error answer, then it closes)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()

    def serve(sock: socket.socket) -> None:
        conn = NativeConnection(Role.SERVER)
        with sock:
            while not done.is_set():
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                conn.receive_data(data)
                while (event := conn.next_event()) is not NEED_DATA:
                    if isinstance(event, ConnectionClosed):
                        return
                    if isinstance(event, Hello) and event.version not in speaks:
                        refusal = ErrorReply(
                            event.request_id,
                            Status.PROTOCOL,
                            f"protocol version {event.version} is not supported (this daemon "
                            f"speaks {max(speaks)})",
                        )
                        data, close = _joined(conn.send_parts(refusal)), True
                    elif isinstance(event, Hello):
                        version = min(event.version, max(speaks))
                        welcome = Welcome(event.request_id, version, "", 1 << 20, 1 << 20)
                        data, close = _joined(conn.send_parts(welcome)), False
                    else:
                        data, close = answer(conn, event)
                    sock.sendall(data)
                    if close:
                        return

    def accept() -> None:
        while not done.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(0.2)
            threading.Thread(target=serve, args=(sock,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join(10)
        listener.close()


def _joined(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _too_many(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
    assert isinstance(event, GetMany)
    n = len(event.keys) + 1
    return _joined(conn.send_parts(GetManyResult(event.request_id, (1,) * n), [b"x"] * n)), False


def _none(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
    return _joined(conn.send_parts(GetManyResult(event.request_id, ()))), False


@pytest.mark.parametrize("answer", [_too_many, _none], ids=["more lengths", "no lengths"])
def test_a_get_many_answer_that_does_not_fit_the_keys_is_a_protocol_error(
    answer: Answer,
) -> None:
    keys = [os.urandom(16) for _ in range(3)]
    with peer(answer) as port:
        url = f"kv://127.0.0.1:{port}?retries=0&timeout=10"
        with Client.connect(url) as client, pytest.raises(RemoteProtocolError):
            client.get_many(keys)

        async def main() -> None:
            async with AsyncClient.connect(url) as client:
                with pytest.raises(RemoteProtocolError):
                    await client.get_many(keys)

        asyncio.run(main())


def _more_than_asked(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
    assert isinstance(event, Lookup)
    return _joined(conn.send_parts(LookupResult(event.request_id, len(event.keys) + 1))), False


def test_a_lookup_count_over_the_keys_asked_is_a_protocol_error() -> None:
    keys = [os.urandom(16) for _ in range(3)]
    with peer(_more_than_asked) as port:
        url = f"kv://127.0.0.1:{port}?retries=0&timeout=10"
        with Client.connect(url) as client:
            with pytest.raises(RemoteProtocolError, match="lookup"):
                client.lookup(keys)
            # A daemon that answered nonsense does not get the connection back for reuse.
            assert client._transport._shards[0]._idle == []  # a one-process peer: one shard

        async def main() -> None:
            async with AsyncClient.connect(url) as client:
                with pytest.raises(RemoteProtocolError, match="lookup"):
                    await client.lookup(keys)

        asyncio.run(main())


BLOCK = 1 << 20  # payload bytes of the block the peer starts to send


def _half_a_block(close: bool) -> Answer:
    """Answer a Get with a block's header and half its payload (0xAA bytes), then close the
    connection or send nothing more."""

    def answer(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
        assert isinstance(event, Get)
        length = HEADER_BYTES + BLOCK
        frame = _joined(conn.send_parts(GetResult(event.request_id, length), [b"\xaa" * length]))
        return frame[: len(frame) - BLOCK // 2], close

    return answer


@pytest.mark.parametrize("close", [True, False], ids=["closed", "stalled"])
def test_a_get_into_that_fails_part_way_leaves_no_partial_block(close: bool) -> None:
    with peer(_half_a_block(close)) as port:
        url = f"kv://127.0.0.1:{port}?retries=0&timeout=2"
        buffer = bytearray(b"\x55" * (2 * BLOCK))
        # Cut off mid-answer is a failed connection (retried where retries are allowed).
        expected = TransportError if close else KVOffloadError
        with Client.connect(url) as client, pytest.raises(expected):
            client.get_into(os.urandom(16), buffer)
        assert b"\xaa" not in buffer  # what arrived is zeroed ...
        assert buffer[-1] == 0x55  # ... and what no byte reached is left alone

        async def main() -> None:
            async with AsyncClient.connect(url) as client:
                with pytest.raises(expected):
                    await client.get_into(os.urandom(16), buffer)

        buffer[:] = b"\x55" * (2 * BLOCK)
        asyncio.run(main())
        assert b"\xaa" not in buffer


def _exists_answer(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
    assert isinstance(event, Exists)
    return _joined(conn.send_parts(ExistsResult(event.request_id, True))), False


def test_a_daemon_of_protocol_1_is_spoken_to_in_protocol_1() -> None:
    """A client newer than its daemon: the daemon refuses Hello version 2, the client says
    Hello again in version 1 (the daemon's Welcome then has no shard fields) and works."""
    with peer(_exists_answer, speaks=(1,)) as port:
        url = f"kv://127.0.0.1:{port}?retries=0&timeout=10"
        with Client.connect(url) as client:
            assert client.exists(os.urandom(16))

        async def main() -> None:
            async with AsyncClient.connect(url) as client:
                assert await client.exists(os.urandom(16))

        asyncio.run(main())
    # A daemon that speaks none of the client's versions: down to 1, then the refusal stands.
    with peer(_exists_answer, speaks=(9,)) as port, pytest.raises(RemoteProtocolError):
        Client.connect(f"kv://127.0.0.1:{port}?retries=0&timeout=10")


def test_a_protocol_2_daemon_gets_puts_without_metadata() -> None:
    """Block metadata is a protocol 3 field, which a protocol 2 daemon refuses as unknown: a
    client says Hello in 3, falls back to 2, and then leaves the metadata out of its puts."""
    seen: list[Event] = []

    def answer(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
        if isinstance(event, (Put, PutMany)):
            seen.append(event)  # answered once its payload is in
            return b"", False
        assert isinstance(event, PayloadEnd)
        put = next(e for e in seen if e.request_id == event.request_id)
        done = PutDone if isinstance(put, Put) else PutManyDone
        return _joined(conn.send_parts(done(event.request_id))), False

    meta = BlockMeta((1, 2, 3), block_hash=5)
    for speaks, carried in (((1, 2), False), ((1, 2, 3), True)):
        seen.clear()
        with peer(answer, speaks=speaks) as port:
            url = f"kv://127.0.0.1:{port}?retries=0&timeout=10"
            with Client.connect(url) as client:
                client.put(bytes(16), b"v", meta=meta)
                client.put_many([(bytes(16), b"v")], metas=[meta])

            async def main(url: str) -> None:
                async with AsyncClient.connect(url) as client:
                    await client.put(bytes(16), b"v", meta=meta)
                    await client.put_many([(bytes(16), b"v")], metas=[meta])

            asyncio.run(main(url))
        sent = [e.block_meta if isinstance(e, Put) else (e.block_metas or (None,))[0]
                for e in seen if isinstance(e, (Put, PutMany))]  # fmt: skip
        assert len(sent) == 4
        assert sent == ([meta.encode()] * 4 if carried else [None] * 4)


def test_an_error_answer_in_the_middle_of_an_exists_run_is_raised_and_the_connection_goes_on() -> (
    None
):
    """`exists_many` sends its Exists requests in runs; one answered with an error in the
    middle of a run is raised (the store's error, not a lost connection), every other answer of
    the run is read, so the next call gets its own answers (not the leftovers)."""
    keys = [os.urandom(16) for _ in range(300)]
    failing = keys[140]  # in the middle of the second run

    def answer(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
        assert isinstance(event, Exists)
        if event.key == failing:
            reply: Event = ErrorReply(event.request_id, Status.STORAGE_IO, "a read failed")
        else:
            reply = ExistsResult(event.request_id, event.key[0] % 2 == 0)
        return _joined(conn.send_parts(reply)), False

    good = [k for k in keys if k != failing]
    expected = [k[0] % 2 == 0 for k in good]
    with peer(answer) as port:
        url = f"kv://127.0.0.1:{port}?retries=0&timeout=10"
        with Client.connect(url) as client:
            with pytest.raises(KVOffloadError, match="a read failed") as raised:
                client.exists_many(keys)
            assert not isinstance(raised.value, TransportError)
            assert client.exists_many(good) == expected

        async def main() -> None:
            async with AsyncClient.connect(url) as client:
                with pytest.raises(KVOffloadError, match="a read failed") as raised:
                    await client.exists_many(keys)
                assert not isinstance(raised.value, TransportError)
                assert await client.exists_many(good) == expected

        asyncio.run(main())
