"""The `kv://` client against a peer that breaks the protocol in ways the codec alone cannot
see (an answer that does not fit its request): it raises RemoteProtocolError, a KVOffloadError.

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
from kvoffload.client_sdk.wire.native import (
    NEED_DATA,
    ConnectionClosed,
    GetMany,
    GetManyResult,
    Hello,
    NativeConnection,
    Role,
    Welcome,
)
from kvoffload.errors import RemoteProtocolError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

Answer = Callable[[GetMany], tuple[GetManyResult, list[bytes]]]


@contextlib.contextmanager
def peer(answer: Answer) -> Iterator[int]:
    """A native-protocol server that welcomes every connection and answers GetMany with
    `answer`; yields its port."""
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
                    sock.sendall(b"".join(bytes(p) for p in _reply(conn, event, answer)))

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


def _reply(conn: NativeConnection, event: object, answer: Answer) -> list[bytes | memoryview]:
    if isinstance(event, Hello):
        return conn.send_parts(Welcome(event.request_id, 1, "", 1 << 20, 1 << 20))
    assert isinstance(event, GetMany), event
    result, payload = answer(event)
    return conn.send_parts(result, payload)


def _too_many(event: GetMany) -> tuple[GetManyResult, list[bytes]]:
    return GetManyResult(event.request_id, (1,) * (len(event.keys) + 1)), [b"x"] * (
        len(event.keys) + 1
    )


def _none(event: GetMany) -> tuple[GetManyResult, list[bytes]]:
    return GetManyResult(event.request_id, ()), []


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
