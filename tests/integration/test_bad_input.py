"""A live daemon under garbage, slow partial frames, abrupt disconnects and too many clients:
it closes the offending connection, keeps serving the others, loses nothing, stays bounded."""

from __future__ import annotations

import os
import random
import select
import socket
from collections.abc import Callable
from typing import Any

import pytest
from probes import closed, eventually, pinned, refused, small_window

from kvoffload.client_sdk import Client
from kvoffload.wire.native.connection import (
    NEED_DATA,
    ConnectionClosed,
    ErrorReply,
    Get,
    GetResult,
    Hello,
    NativeConnection,
    Put,
    Role,
    Welcome,
)
from kvoffload.wire.native.frames import FRAME, MAGIC
from kvoffload.wire.status import Status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
Start = Callable[..., Any]

LIMITS = """
[native]
frame_timeout_s = 1.0
idle_timeout_s = 2.0
max_connections = 8
"""


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def _answers(sock: socket.socket) -> list[object]:
    """Read until the daemon closes the connection; the events it sent."""
    conn = NativeConnection(Role.CLIENT)
    conn.send(Hello(1))  # lets the codec accept answers (and a connection-level error)
    events: list[object] = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            data = b""
        conn.receive_data(data)
        while (event := conn.next_event()) is not NEED_DATA:
            events.append(event)
            if isinstance(event, ConnectionClosed):
                return events


def _seed(port: int) -> dict[bytes, bytes]:
    # Three sizes: a 64 MiB arena has 16 slabs, one size class each, so many distinct sizes
    # would evict one another by design, which is not what these tests are about.
    sizes = (1000, 50_000, 150_000)
    blocks = {os.urandom(16): os.urandom(sizes[i % 3]) for i in range(20)}
    with Client.connect(f"kv://127.0.0.1:{port}") as client:
        for key, value in blocks.items():
            client.put(key, value)
    return blocks


def _intact(port: int, blocks: dict[bytes, bytes]) -> None:
    with Client.connect(f"kv://127.0.0.1:{port}") as client:
        for key, value in blocks.items():
            assert client.get(key) == value
        assert client.stats().corrupt_blocks == 0


def test_garbage_gets_a_protocol_error_and_others_carry_on(start_daemon: Start) -> None:
    daemon = start_daemon(config=LIMITS)
    blocks = _seed(daemon.port)
    rng = random.Random(7)
    garbage = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        bytes(rng.randrange(256) for _ in range(5000)),
        FRAME.pack(MAGIC, 1, 2, 0, 1, 10, 1 << 60),  # a put of an exabyte: refused, not allocated
        FRAME.pack(MAGIC, 1, 3, 0, 1, 1 << 30, 0),  # a gigabyte header
        FRAME.pack(MAGIC, 9, 1, 0, 1, 0, 0),  # unknown version
        FRAME.pack(MAGIC, 1, 1, 0, 1, 1, 0) + b"\xc1",  # undecodable msgpack
    ]
    rss_before = daemon.rss_bytes()
    for _ in range(5):
        for data in garbage:
            with _connect(daemon.port) as sock:
                sock.sendall(data)
                events = _answers(sock)
            assert isinstance(events[0], ErrorReply) and events[0].status == Status.PROTOCOL
            assert events[0].request_id == 0 and isinstance(events[-1], ConnectionClosed)
    # Nothing above was allocated: the daemon's memory did not grow by the declared sizes.
    assert daemon.rss_bytes() - rss_before < 64 << 20
    _intact(daemon.port, blocks)


def test_requests_without_a_valid_hello_are_refused(start_daemon: Start) -> None:
    daemon = start_daemon(config='[tenants.a]\ntoken = "right"\n')
    client = NativeConnection(Role.CLIENT)
    with _connect(daemon.port) as sock:  # a Get before any Hello
        forged = NativeConnection(Role.CLIENT)
        forged.send(Hello(1))
        sock.sendall(forged.send(Get(2, bytes(16))))
        events = _answers(sock)
    assert isinstance(events[0], ErrorReply) and events[0].status == Status.PROTOCOL
    with _connect(daemon.port) as sock:  # a wrong token, with a request pipelined behind it
        sock.sendall(client.send(Hello(1, token="wrong")) + client.send(Get(2, bytes(16))))
        events = _answers(sock)
    assert len(events) == 2 and isinstance(events[0], ErrorReply)
    assert events[0].status == Status.AUTH and events[0].request_id == 1


def test_connections_without_a_hello_are_closed(start_daemon: Start) -> None:
    # Idle connections are kept for 300 s; one that never says Hello only for hello_timeout_s.
    daemon = start_daemon(config="[native]\nhello_timeout_s = 1.0\n")
    key = os.urandom(16)
    conn = NativeConnection(Role.CLIENT)
    with _connect(daemon.port) as greeted:
        greeted.sendall(conn.send(Hello(1)))
        with _connect(daemon.port) as silent:  # opened after the Hello: its deadline is later
            events = _answers(silent)
        assert isinstance(events[0], ErrorReply) and events[0].status == Status.DEADLINE
        assert refused(daemon, "hello timeout") == 1.0
        # The connection that said Hello is not subject to the deadline: it is still served.
        greeted.sendall(conn.send(Get(2, key)))
        answers: list[object] = []
        while len(answers) < 2:
            conn.receive_data(greeted.recv(65536))
            while (event := conn.next_event()) is not NEED_DATA:
                answers.append(event)
    assert isinstance(answers[0], Welcome) and answers[1] == GetResult(2, None)


def test_a_large_header_before_hello_is_refused_at_once(start_daemon: Start) -> None:
    daemon = start_daemon()  # frame_timeout_s = 60: only the pre-Hello limit answers in time
    for head in (
        FRAME.pack(MAGIC, 1, 1, 0, 1, 1 << 20, 0),  # a 1 MiB header, under max_header_bytes
        FRAME.pack(MAGIC, 1, 1, 0, 1, 10, 1000),  # a payload: a Hello has none
    ):
        with _connect(daemon.port) as sock:
            sock.sendall(head + bytes(1000))
            events = _answers(sock)
        assert isinstance(events[0], ErrorReply) and events[0].status == Status.PROTOCOL
        assert "exceeds the limit" in events[0].message
    _intact(daemon.port, _seed(daemon.port))  # after Hello the full limits apply


def test_slow_partial_frames_are_cut_off(start_daemon: Start) -> None:
    daemon = start_daemon(config=LIMITS)
    blocks = _seed(daemon.port)
    conn = NativeConnection(Role.CLIENT)
    frame = conn.send(Hello(1)) + conn.send(Put(2, bytes(16), 100_000), [bytes(100_000)])
    with _connect(daemon.port) as slow:
        slow.sendall(frame[:1000])
        # While that frame trickles, another client is served normally.
        _intact(daemon.port, blocks)
        assert _trickle_until_closed(slow, frame[1000:1500])
    with Client.connect(f"kv://127.0.0.1:{daemon.port}") as client:
        assert client.get(bytes(16)) is None  # the partial put never became visible
    _intact(daemon.port, blocks)


def _trickle_until_closed(sock: socket.socket, data: bytes) -> bool:
    """Send `data` a byte every 20 ms; True once the daemon has closed the connection."""
    for i in range(len(data)):
        try:
            sock.sendall(data[i : i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return True
        if select.select([sock], [], [], 0.02)[0]:
            try:
                reply = sock.recv(65536)
            except ConnectionResetError:
                return True
            if not reply or _is_goodbye(reply):
                return True
    return False


def _is_goodbye(data: bytes) -> bool:
    conn = NativeConnection(Role.CLIENT)
    conn.send(Hello(1))
    conn.receive_data(data)
    events = []
    while (event := conn.next_event()) is not NEED_DATA:
        events.append(event)
    return any(isinstance(e, ErrorReply) and e.request_id == 0 for e in events)


def test_idle_connections_are_closed(start_daemon: Start) -> None:
    daemon = start_daemon(config=LIMITS)
    conn = NativeConnection(Role.CLIENT)
    with _connect(daemon.port) as sock:
        sock.sendall(conn.send(Hello(1)))
        events = _answers(sock)  # returns once the daemon hangs up
    assert isinstance(events[0], Welcome) and isinstance(events[-1], ConnectionClosed)


def test_abrupt_disconnects_lose_nothing(start_daemon: Start) -> None:
    daemon = start_daemon(config=LIMITS)
    blocks = _seed(daemon.port)
    for cut in (10, 60, 5000, 99_000):
        conn = NativeConnection(Role.CLIENT)
        stream = (
            conn.send(Hello(1))
            + conn.send(Get(2, next(iter(blocks))))
            + conn.send(Put(3, bytes(16), 100_000), [bytes(100_000)])
        )
        sock = _connect(daemon.port)
        sock.sendall(stream[:cut])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # RST, mid-frame
    _intact(daemon.port, blocks)
    with Client.connect(f"kv://127.0.0.1:{daemon.port}") as client:
        assert client.get(bytes(16)) is None


def test_too_many_connections_are_refused_cleanly(start_daemon: Start) -> None:
    daemon = start_daemon(config=LIMITS)
    held = []
    for _ in range(8):  # max_connections
        sock = _connect(daemon.port)
        sock.sendall(NativeConnection(Role.CLIENT).send(Hello(1)))
        sock.recv(65536)  # the Welcome: this connection now counts
        held.append(sock)
    with _connect(daemon.port) as extra:
        events = _answers(extra)
    assert isinstance(events[0], ErrorReply) and events[0].status == Status.UNAVAILABLE
    for sock in held:
        sock.close()
    # Once they are gone, new clients get in again.
    with Client.connect(f"kv://127.0.0.1:{daemon.port}?retries=5&backoff=0.1") as client:
        client.put(bytes(16), b"after")
        assert client.get(bytes(16)) == b"after"


@pytest.mark.parametrize("half_close", [False, True], ids=["open", "half-closed"])
def test_a_client_that_stops_reading_is_cut_off_and_its_blocks_released(
    start_daemon: Start, half_close: bool
) -> None:
    # Queued answers pin their blocks; a peer that takes none of them for frame_timeout_s is
    # closed (also once it has half-closed and the daemon is only flushing), which releases them.
    daemon = start_daemon(config=LIMITS)
    keys = [os.urandom(16) for _ in range(30)]
    with Client.connect(f"kv://127.0.0.1:{daemon.port}") as client:
        for key in keys:
            client.put(key, os.urandom(1 << 20))
        conn = NativeConnection(Role.CLIENT)
        hello = conn.send(Hello(1))
        gets = b"".join(conn.send(Get(i, k)) for i, k in enumerate(keys, start=2))
        with small_window(daemon.port) as sock:
            sock.sendall(hello + gets)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            # ... and never reads. The daemon serves the Gets, gives up, releases the views.
            assert eventually(lambda: client.stats().store["gets"] == len(keys))
            assert eventually(lambda: pinned(client) == 0)
            assert refused(daemon, "send timeout") == 1.0
            assert closed(sock)
