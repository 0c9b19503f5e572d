"""The `kv://` client's data path against a real daemon: a get_into's payload lands straight
in the caller's buffer, and a block that does not match its checksum is a counted miss with
the buffer zeroed, wherever the damage is and whatever the buffer's size; the socket's kernel
timeouts (SO_RCVTIMEO, no Python timeout) still end a request that gets no answer."""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Any

import pytest

from kvoffload.client_sdk import AsyncClient, Client
from kvoffload.errors import DeadlineExceededError, KVOffloadError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _put_damaged(client: Client, key: bytes, value: bytes, at: int) -> None:
    """Store `value` under `key` with a header sealed for it, then byte `at` flipped."""
    sealed = client._requests.prepare_put(key, value, None, None)
    damaged = bytearray(value)
    damaged[at] ^= 0x01
    client._transport.put(sealed.key, (sealed.header, damaged), None)


@pytest.mark.parametrize("size", [1, 600, 64 << 10, (2 << 20) + 3, 8 << 20])
def test_a_get_into_checks_every_piece_of_the_payload(start_daemon: Any, size: int) -> None:
    daemon = start_daemon("--dram", "256MiB")
    value = os.urandom(size)
    with Client.connect(daemon.url()) as client:
        client.put(b"g" * 16, value)
        out = bytearray(size)
        assert client.get_into(b"g" * 16, out) == size
        assert out == value
        for n, at in enumerate({0, size // 2, size - 1}):
            key = bytes([n]) * 16
            _put_damaged(client, key, value, at)
            out = bytearray(b"\x55" * size)
            assert client.get_into(key, out) is None
            assert out == bytes(size)  # no byte of the damaged block stays
            assert client.stats().corrupt_blocks == n + 1


def test_an_async_get_into_checks_the_payload_too(start_daemon: Any) -> None:
    import asyncio

    daemon = start_daemon("--dram", "256MiB")
    value = os.urandom(3 << 20)
    with Client.connect(daemon.url()) as client:
        _put_damaged(client, b"d" * 16, value, len(value) - 7)
        client.put(b"g" * 16, value)

    async def main() -> None:
        async with AsyncClient.connect(daemon.url()) as client:
            out = bytearray(len(value))
            assert await client.get_into(b"g" * 16, out) == len(value)
            assert out == value
            assert await client.get_into(b"d" * 16, out) is None
            assert out == bytes(len(value))

    asyncio.run(main())


def test_a_daemon_that_never_answers_is_a_deadline() -> None:
    # Accepts (the kernel's backlog does) and never reads nor answers: Hello and then the get
    # run into the deadline.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        url = f"kv://127.0.0.1:{port}?retries=0&timeout=1&connect_timeout=1"
        with Client.connect(url) as client, pytest.raises(DeadlineExceededError):
            client.get_into(b"k" * 16, bytearray(16))
    finally:
        listener.close()


@pytest.mark.timeout(60)
def test_deadlines_hold_while_signals_interrupt_the_waits() -> None:
    # A signal with a Python handler makes a blocking recv return EINTR and Python retry it
    # (PEP 475); a deadline must count the time already spent, not restart on each retry (a
    # kernel SO_RCVTIMEO did restart: this call hung). And a hang here is the pytest timeout.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    main = threading.get_ident()
    stop = threading.Event()

    def interrupt() -> None:
        while not stop.wait(0.2):
            signal.pthread_kill(main, signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, lambda *_: None)
    ticker = threading.Thread(target=interrupt, daemon=True)
    ticker.start()
    try:
        url = f"kv://127.0.0.1:{port}?retries=0&timeout=1&connect_timeout=1"
        with pytest.raises(DeadlineExceededError), Client.connect(url) as client:
            client.get_into(b"k" * 16, bytearray(16))
    finally:
        stop.set()
        ticker.join()
        signal.signal(signal.SIGUSR1, old)
        listener.close()


@pytest.mark.parametrize(
    ("size", "room"),
    [
        (0, 100),  # the answer's header ends short of the read: nothing spills
        (100, 100),
        (1000, 70_000),  # a narrower length field than the buffer's: header shorter
        (66_000, 70_000),  # as wide: the payload starts where foreseen, but is shorter
        (70_000, 1000),  # too big for the buffer: an error, the buffer left zeroed
    ],
)
def test_a_get_into_a_buffer_of_another_size(start_daemon: Any, size: int, room: int) -> None:
    """A buffer larger than the value (the answer's length field narrower or as wide as the
    buffer's size would need), equal to it, or too small: the bytes end up where they belong,
    damaged or not, and nothing past the value is written."""
    daemon = start_daemon("--dram", "256MiB")
    value = os.urandom(size)
    with Client.connect(daemon.url()) as client:
        client.put(b"g" * 16, value)
        out = bytearray(b"\x55" * room)
        if size > room:
            with pytest.raises(KVOffloadError):
                client.get_into(b"g" * 16, out)
            assert out.strip(b"\x00") in (b"", b"\x55" * len(out.strip(b"\x00")))
            return
        assert client.get_into(b"g" * 16, out) == size
        assert out[:size] == value
        assert out[size:] == b"\x55" * (room - size)
        if size:
            _put_damaged(client, b"d" * 16, value, size - 1)
            out = bytearray(b"\x55" * room)
            assert client.get_into(b"d" * 16, out) is None
            assert out[:size] == bytes(size)
            assert client.stats().corrupt_blocks == 1
