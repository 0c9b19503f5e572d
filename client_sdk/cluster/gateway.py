"""Blocking calls to etcd's v3 HTTP/JSON gateway (the messages: `kvoffload.wire.membership`).

With `EtcdAccess` credentials the gateway authenticates once (etcd's v3 auth API) and sends the
token with every call; a token that lapsed (etcd's simple tokens expire) is renewed once per
call. etcds:// calls go over TLS, verifying etcd's certificate against the CA given (or the
system's), with a client certificate where one is given.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

from kvoffload.errors import ConfigError, RemoteProtocolError, TransportError
from kvoffload.wire.membership import (
    NO_ACCESS,
    EtcdAccess,
    Request,
    auth_request,
    etcd_refusal,
    parse_auth,
)

__all__ = ["EtcdGateway", "etcd_ssl_context"]

# Largest answer read from etcd: a listing of a few thousand node records fits many times over.
_MAX_ANSWER = 16 << 20


class EtcdGateway:
    """One etcd endpoint. Unary calls open a short connection each (they are rare: a listing, a
    lease keepalive every few seconds); a watch holds its own connection until closed."""

    def __init__(
        self, host: str, port: int, timeout_s: float = 2.0, access: EtcdAccess = NO_ACCESS
    ) -> None:
        """Raises: ConfigError: a CA, certificate or password file cannot be read."""
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._access = access
        self._credentials = access.credentials()  # read now: a bad password file fails at once
        self._context = etcd_ssl_context(access)
        self._who = f"user {access.user!r}" if access.user else "a client without credentials"
        self._token = ""
        self._lock = threading.Lock()
        self._watch: http.client.HTTPConnection | None = None
        self._closed = False

    def __repr__(self) -> str:
        scheme = "https" if self._context else "http"
        return f"EtcdGateway({scheme}://{self.host}:{self.port})"

    def _connection(self) -> http.client.HTTPConnection:
        if self._context is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        return http.client.HTTPSConnection(
            self.host, self.port, timeout=self.timeout_s, context=self._context
        )

    def _headers(self) -> dict[str, str]:
        """The headers of a call, authenticating first when credentials are set and no token
        is held.

        Raises:
            AuthError: etcd refused the user or password.
            TransportError: etcd is unreachable.
        """
        headers = {"Content-Type": "application/json"}
        if self._credentials is not None:
            if not self._token:
                # Read again: a password changed in etcd and in its file is used from the
                # next token on, without a restart.
                self._credentials = self._access.credentials() or self._credentials
                self._token = parse_auth(self._post(auth_request(*self._credentials), headers))
            headers["Authorization"] = self._token
        return headers

    def call(self, request: Request) -> dict[str, Any]:
        """POST one request and return its decoded answer.

        Raises:
            AuthError: etcd refused this gateway's user (a wrong password, no permission) or
                wants credentials it was not given.
            TransportError: etcd is unreachable, slow or answered with an HTTP error.
            RemoteProtocolError: the answer is not a JSON object.
        """
        try:
            return self._post(request, self._headers())
        except _TokenLapsed:
            self._token = ""  # etcd forgot it (a restart, its TTL): one new token, one retry
            return self._post(request, self._headers())

    def _post(self, request: Request, headers: dict[str, str]) -> dict[str, Any]:
        path, body = request
        conn = self._connection()
        try:
            conn.request("POST", path, json.dumps(body), headers)
            resp = conn.getresponse()
            raw = resp.read(_MAX_ANSWER + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise TransportError(f"etcd {self.host}:{self.port}: {exc}") from None
        finally:
            conn.close()
        if resp.status != 200:
            if resp.status == 401 and "Authorization" in headers:
                raise _TokenLapsed
            refusal = etcd_refusal(resp.status, raw, self._who)
            if refusal is not None:
                raise refusal
            raise TransportError(f"etcd {self.host}:{self.port}: HTTP {resp.status} {raw[:200]!r}")
        return _object(raw)

    def watch(self, request: Request) -> Iterator[bytes]:
        """Open a watch stream and yield its messages (one JSON object each) until etcd ends
        it or `close` is called; then the iterator stops.

        Raises:
            TransportError: the stream could not be opened or broke.
        """
        path, body = request
        headers = self._headers()
        conn = self._connection()
        try:
            conn.request("POST", path, json.dumps(body), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                if resp.status == 401:
                    self._token = ""  # the next call authenticates again
                refusal = etcd_refusal(resp.status, resp.read(4096), self._who)
                if refusal is not None:
                    raise refusal
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


class _TokenLapsed(Exception):
    """etcd no longer knows the token sent (HTTP 401): authenticate again."""


def etcd_ssl_context(access: EtcdAccess) -> ssl.SSLContext | None:
    """The TLS context of an etcds:// endpoint (None for etcd://): etcd's certificate checked
    against `access.ca` (or the system's CAs), `access.cert`/`key` presented when given.

    Raises:
        ConfigError: a file cannot be loaded.
    """
    if not access.tls:
        return None
    try:
        context = ssl.create_default_context(cafile=access.ca or None)
        if access.cert:
            context.load_cert_chain(access.cert, access.key or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"etcd TLS files (ca/cert/key): {exc}") from None
    return context


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
