"""One connection's pipelined requests do not hold the daemon's loop: a peer that sends
hundreds of frames at once (garbage or not) lets another client's request in after a few of
them, on both fronts; and a peer that breaks the protocol on connection after connection does
not get a log line each time."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from nvme_raw import HOSTNQN, RawQueue

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
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp.connection import CapsuleCmd, CapsuleResp

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
Start = Callable[..., Any]

PIPELINED = 1000  # Exists frames of ~40 B: all of them fit in one socket buffer


def _stopped(pid: int) -> None:
    """SIGSTOP the daemon and wait until it is stopped (the signal is delivered when the kernel
    next schedules it), so that what the test sends next finds every socket unread."""
    os.kill(pid, signal.SIGSTOP)
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "tT":
        time.sleep(0.001)


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
    sockets are ready in the same loop turn. Before the fix, when it served A first it answered
    all of A's frames before it looked at B (every Exists said False); now A yields every few
    requests and B's put lands while A's frames are still being answered."""
    daemon = start_daemon()
    a, a_conn = _session(daemon.port)
    b, b_conn = _session(daemon.port)
    # Which of two sockets that became ready while the daemon was stopped it serves first is the
    # loop's choice; each round where A goes first shows whether A yields (5 rounds: before the
    # fix, at least one of them had all 1000 answered first, in every run seen).
    ids = itertools.count(2)
    for _ in range(5):
        key = os.urandom(16)
        pipelined = b"".join(a_conn.send(Exists(next(ids), key)) for _ in range(PIPELINED))
        put = b_conn.send(Put(next(ids), key, 100), [bytes(100)])
        _stopped(daemon.proc.pid)
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


def test_an_nvme_queue_takes_turns_too(start_daemon: Start) -> None:
    """The same on the NVMe/TCP front: host A's I/O queue holds 100 KV Exist commands (of its
    121 slots) when host B's in-capsule KV Store arrives. Before the fix every Exist was
    answered first (all "no such key"); now B's store lands after a few of them."""
    daemon = start_daemon()
    port = daemon.ports["nvme"]
    queues = []
    for host in "ab":
        admin = RawQueue(port)
        hostnqn = HOSTNQN[:-2] + host * 2
        c = admin.connect(hostnqn=hostnqn)
        admin.enable()
        assert admin.command(nc.set_features(admin.cid(), 0x07, 0))[0].ok
        io = RawQueue(port)
        assert io.connect(1, cntlid=c.dw0, sqsize=120, hostnqn=hostnqn).ok
        queues.append((admin, io))
    a, b = queues[0][1], queues[1][1]
    # Which of two sockets that became ready while the daemon was stopped it serves first is the
    # loop's choice; each round where A goes first shows whether A yields (5 rounds: before the
    # fix, at least one of them had all 100 answered first, in every run seen).
    for _ in range(5):
        key = os.urandom(16)
        exists = b"".join(a.conn.send(CapsuleCmd(nc.kv_exist(a.cid(), 1, key))) for _ in range(100))
        store = b.conn.send(
            CapsuleCmd(nc.kv_store(b.cid(), 1, key, 4, in_capsule=True), 4), [b"good"]
        )
        _stopped(daemon.proc.pid)
        try:
            a.send_raw(exists)
            b.send_raw(store)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        (done,) = b.events()
        assert isinstance(done, CapsuleResp) and done.completion.ok
        answers: list[bool] = []
        while len(answers) < 100:
            for event in a.events():
                assert isinstance(event, CapsuleResp)
                answers.append(event.completion.ok)
        assert answers == sorted(answers)  # in order: misses until B's store, hits after it
        assert answers.count(False) < 50, f"B waited for {answers.count(False)} of A's"
