"""The raw socket reference of `bench net`: a Python server process that `recv_into`s a
preallocated buffer and answers with 1 byte (put) or sends a preallocated buffer (get), and a
client that uses `sendmsg` and `recv_into`. The floor of any Python protocol on this machine.

The protocol: b"P" + u64 n + n bytes -> b"k"; b"G" + u64 n -> n bytes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import socket
import struct
from collections.abc import Iterator

__all__ = ["RawClient", "raw_connection", "raw_reference"]

_HDR = struct.Struct("<cQ")


def _raw_server(listener: socket.socket, max_size: int) -> None:
    """Serve the raw protocol to one connection after another."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        conn, _ = listener.accept()
        raw_connection(conn, max_size)


def raw_connection(conn: socket.socket, max_size: int) -> None:
    """Serve one connection: b"P" + u64 n + n bytes -> b"k"; b"G" + u64 n -> n bytes."""
    view = memoryview(bytearray(max_size))
    head = bytearray(_HDR.size)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while _recv_exact(conn, memoryview(head)):
            op, n = _HDR.unpack(head)
            if op == b"P":
                if not _recv_exact(conn, view[:n]):
                    break
                conn.sendall(b"k")
            else:
                conn.sendall(view[:n])


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    pos = 0
    while pos < len(view):
        n = sock.recv_into(view[pos:])
        if n == 0:
            return False
        pos += n
    return True


class RawClient:
    """The client side: `depth` requests back to back, then their answers."""

    def __init__(self, port: int, max_size: int, max_depth: int = 1) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(max_size))
        self.ack = memoryview(bytearray(max_depth))
        self.server_pid: int | None = None  # set by raw_reference: the server's CPU is a row

    def _send(self, parts: list[memoryview | bytes]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            sent = self.sock.sendmsg(views)
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def put(self, value: memoryview, depth: int = 1) -> None:
        self._send([_HDR.pack(b"P", len(value)), value] * depth)
        _recv_exact(self.sock, self.ack[:depth])

    def get(self, size: int, depth: int = 1) -> None:
        self._send([_HDR.pack(b"G", size)] * depth)
        for _ in range(depth):
            _recv_exact(self.sock, self.buf[:size])

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def raw_reference(max_size: int, max_depth: int) -> Iterator[RawClient]:
    """A raw server process on loopback and a client to it."""
    listener = socket.create_server(("127.0.0.1", 0))
    ctx = multiprocessing.get_context("fork")
    server = ctx.Process(target=_raw_server, args=(listener, max_size), daemon=True)
    server.start()
    client = RawClient(listener.getsockname()[1], max_size, max_depth)
    client.server_pid = server.pid
    listener.close()
    try:
        yield client
    finally:
        client.close()
        server.terminate()
        server.join(10)
