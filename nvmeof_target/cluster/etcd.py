"""The node's calls to etcd's v3 HTTP/JSON gateway: plain or TLS, with or without a user.

The SDK's `EtcdGateway` does the same for clients (and watches); the daemon never imports the
SDK (DESIGN §2), so the node keeps this small unary-only client beside its registration. The
messages, the URL and the reading of etcd's refusals are shared (`kvoffload.wire.membership`).
"""

from __future__ import annotations

import http.client
import json
import ssl
from typing import Any

from kvoffload.errors import ConfigError, TransportError
from kvoffload.wire.membership import EtcdEndpoint, Request, auth_request, etcd_refusal, parse_auth

__all__ = ["EtcdClient"]

# Largest answer read: the node reads its own record and small lease answers.
_MAX_ANSWER = 1 << 20


class EtcdClient:
    """Unary calls to one etcd endpoint, each on a short connection (a keepalive every few
    seconds); with a user, a token from etcd's auth API goes with every call and is renewed
    once when etcd no longer knows it (a restart of etcd, its token TTL)."""

    def __init__(self, endpoint: EtcdEndpoint, timeout_s: float) -> None:
        """Raises: ConfigError: a CA, certificate or password file cannot be read."""
        access = endpoint.access
        self.where = f"etcd {endpoint.host}:{endpoint.port}"
        self._host, self._port, self._timeout_s = endpoint.host, endpoint.port, timeout_s
        self._access = access
        self._credentials = access.credentials()  # read now: a bad password file fails at once
        self._who = f"user {access.user!r}" if access.user else "a node without credentials"
        self._token = ""
        self._context: ssl.SSLContext | None = None
        if access.tls:
            try:
                self._context = ssl.create_default_context(cafile=access.ca or None)
                if access.cert:
                    self._context.load_cert_chain(access.cert, access.key or None)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"cluster: etcd TLS files (ca/cert/key): {exc}") from None

    def call(self, request: Request) -> dict[str, Any]:
        """POST `request`; its decoded answer.

        Raises:
            AuthError: etcd refused the user (a wrong password, no permission on the prefix).
            TransportError: etcd is unreachable or answered with an HTTP error or nonsense.
        """
        for attempt in range(2):
            headers = {"Content-Type": "application/json"}
            if self._credentials is not None:
                if not self._token:
                    # Read again: a password changed in etcd and in its file is used from the
                    # next token on, without a restart.
                    self._credentials = self._access.credentials() or self._credentials
                    self._token = parse_auth(self._post(auth_request(*self._credentials), headers))
                headers["Authorization"] = self._token
            status, answer, raw = self._post_raw(request, headers)
            if status == 401 and "Authorization" in headers and not attempt:
                self._token = ""  # lapsed: one new token, one retry
                continue
            return self._checked(status, answer, raw)
        raise AssertionError("unreachable")

    def _post(self, request: Request, headers: dict[str, str]) -> dict[str, Any]:
        return self._checked(*self._post_raw(request, headers))

    def _checked(self, status: int, answer: object, raw: bytes) -> dict[str, Any]:
        if status != 200 or not isinstance(answer, dict):
            refusal = etcd_refusal(status, raw, self._who)
            if refusal is not None:
                raise refusal
            raise TransportError(f"{self.where}: HTTP {status} {raw[:200]!r}")
        return answer

    def _post_raw(self, request: Request, headers: dict[str, str]) -> tuple[int, object, bytes]:
        path, body = request
        if self._context is None:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        else:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout_s, context=self._context
            )
        try:
            conn.request("POST", path, json.dumps(body), headers)
            resp = conn.getresponse()
            raw = resp.read(_MAX_ANSWER)
        except (OSError, http.client.HTTPException) as exc:
            raise TransportError(f"{self.where}: {exc}") from None
        finally:
            conn.close()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        return resp.status, answer, raw
