"""Blocking calls to etcd's v3 HTTP/JSON gateway (the messages: `kvoffload.wire.membership`)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

from kvoffload.errors import RemoteProtocolError, TransportError
from kvoffload.wire.membership import Request

__all__ = ["EtcdGateway"]

# Largest answer read from etcd: a listing of a few thousand node records fits many times over.
_MAX_ANSWER = 16 << 20


class EtcdGateway:
    """One etcd endpoint. Unary calls open a short connection each (they are rare: a listing, a
    lease keepalive every few seconds); a watch holds its own connection until closed."""

    def __init__(self, host: str, port: int, timeout_s: float = 2.0) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._lock = threading.Lock()
        self._watch: http.client.HTTPConnection | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"EtcdGateway({self.host}:{self.port})"

    def call(self, request: Request) -> dict[str, Any]:
        """POST one request and return its decoded answer.

        Raises:
            TransportError: etcd is unreachable, slow or answered with an HTTP error.
            RemoteProtocolError: the answer is not a JSON object.
        """
        path, body = request
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read(_MAX_ANSWER + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise TransportError(f"etcd {self.host}:{self.port}: {exc}") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise TransportError(f"etcd {self.host}:{self.port}: HTTP {resp.status} {raw[:200]!r}")
        return _object(raw)

    def watch(self, request: Request) -> Iterator[bytes]:
        """Open a watch stream and yield its messages (one JSON object each) until etcd ends
        it or `close` is called; then the iterator stops.

        Raises:
            TransportError: the stream could not be opened or broke.
        """
        path, body = request
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise TransportError(f"etcd {self.host}:{self.port}: watch got HTTP {resp.status}")
            sock = conn.sock
            if sock is not None:
                # A watch is quiet for long stretches: no read timeout, but TCP keepalives, so
                # an etcd that vanished without a FIN (a cut link) is noticed in ~10 s.
                sock.settimeout(None)
                _keepalive(sock)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise TransportError(f"etcd {self.host}:{self.port}: {exc}") from None
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._watch = conn
        try:
            while True:
                try:
                    line = resp.readline(_MAX_ANSWER)
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    if self._closed:
                        return
                    raise TransportError(f"etcd {self.host}:{self.port}: watch: {exc}") from None
                if not line:
                    return
                if line.strip():
                    yield line
        finally:
            with self._lock:
                self._watch = None
            conn.close()

    def close(self) -> None:
        """End a watch in progress (from any thread); later watches end at once."""
        with self._lock:
            self._closed = True
            conn = self._watch
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):  # already closed by the peer
                conn.sock.shutdown(socket.SHUT_RDWR)


def _object(raw: bytes) -> dict[str, Any]:
    try:
        answer = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise RemoteProtocolError(f"etcd answer is not JSON: {raw[:120]!r}") from None
    if not isinstance(answer, dict):
        raise RemoteProtocolError(f"etcd answer is not a JSON object: {raw[:120]!r}")
    return answer


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 4), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
