"""One connection's pipelined requests do not hold the daemon's loop: a peer that sends
hundreds of frames at once (garbage or not) lets another client's request in after a few of
them, and a peer that breaks the protocol on connection after connection does not get a log
line each time."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import pytest

from kvoffload.wire.native.connection import (
    NEED_DATA,
    ConnectionClosed,
    Exists,
    ExistsResult,
    Hello,
    NativeConnection,
    Put,
    PutDone,
    Role,
    Welcome,
)
from kvoffload.wire.native.frames import FRAME, MAGIC

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
Start = Callable[..., Any]

PIPELINED = 1000  # Exists frames of ~40 B: all of them fit in one socket buffer


def _session(port: int) -> tuple[socket.socket, NativeConnection]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn = NativeConnection(Role.CLIENT)
    sock.sendall(conn.send(Hello(1)))
    assert isinstance(_events(sock, conn, 1)[0], Welcome)
    return sock, conn


def _events(sock: socket.socket, conn: NativeConnection, n: int) -> list[object]:
    out: list[object] = []
    while len(out) < n:
        while (event := conn.next_event()) is not NEED_DATA and len(out) < n:
            assert not isinstance(event, ConnectionClosed)
            out.append(event)
        if len(out) < n:
            conn.receive_data(sock.recv(1 << 16))
    return out


def test_a_pipelining_peer_lets_another_client_in(start_daemon: Start) -> None:
    """A's 1000 Exists(key) and then B's Put(key) reach a stopped daemon; once it runs, both
    sockets are ready in the same loop turn, A's first. Before the fix the daemon answered all
    of A's frames before it looked at B, so every Exists said False; now A yields every few
    requests and B's put lands while A's frames are still being answered."""
    daemon = start_daemon()
    a, a_conn = _session(daemon.port)
    b, b_conn = _session(daemon.port)
    key = os.urandom(16)
    pipelined = b"".join(a_conn.send(Exists(2 + i, key)) for i in range(PIPELINED))
    put = b_conn.send(Put(2, key, 100), [bytes(100)])
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        a.sendall(pipelined)
        b.sendall(put)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert isinstance(_events(b, b_conn, 1)[0], PutDone)
    answers = _events(a, a_conn, PIPELINED)
    assert all(isinstance(e, ExistsResult) for e in answers)
    found = [e.found for e in answers if isinstance(e, ExistsResult)]
    # Answered in order: misses until B's put, hits after it.
    assert found == sorted(found)
    assert found.count(False) < PIPELINED // 2, f"B waited for {found.count(False)} of A's"


def test_protocol_error_lines_are_rate_limited(start_daemon: Start) -> None:
    """100 connections that each send an unknown protocol version: each is closed with an
    error and counted in the metrics, but at most a window's burst (20) of them is logged per
    10 s (before the fix: 100 lines)."""
    daemon = start_daemon()
    bad = FRAME.pack(MAGIC, 9, 1, 0, 1, 0, 0)
    for _ in range(100):
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
            sock.sendall(bad)
            while sock.recv(1 << 16):
                pass
    daemon.stop()
    lines = [line for line in daemon.stderr().splitlines() if "protocol error from" in line]
    # 20 per window; the 100 connections take well under a window, at most across one edge.
    assert 20 <= len(lines) <= 40, len(lines)
