"""What a `kv://` URL says: where the daemon is and how to reach it."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

from kvoffload.client_sdk.transports.core import RETRY_PARAMS, typed_params
from kvoffload.client_sdk.url import StoreURL
from kvoffload.errors import ConfigError

__all__ = ["DEFAULT_PORT", "NativeOptions"]

DEFAULT_PORT = 7480
_PARAMS = {
    "token": "the tenant's secret: proven by challenge-response, never sent",
    "tenant": "the tenant's name (optional: the daemon finds it by the proof)",
    "node": "the node id the daemon must prove it is (optional)",
    "legacy_token": "1: send the token itself to a daemon older than protocol 5",
    **RETRY_PARAMS,
    "pool": "connections of a sync client (default 4)",
    "tls": "1 to connect with TLS",
    "ca": "CA file that signed the daemon's certificate",
    "server_name": "certificate name to expect (default: the URL's host)",
    "data": "how payloads move: kv (through the connection, default) or nixl (docs/guides/nixl.md)",
    "nixl_cache_bytes": "data=nixl: bytes kept registered per connection (default 1 GiB)",
}
_DATA_PATHS = ("kv", "nixl")


@dataclass(frozen=True)
class NativeOptions:
    """Where and how to reach a daemon (from a `kv://` URL)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    token: str = ""
    tenant: str = ""
    node: str = ""
    # Send the token itself (replayable) to a daemon that does not speak challenge–response.
    legacy_token: bool = False
    timeout: float = 30.0
    connect_timeout: float = 5.0
    retries: int = 3
    backoff: float = 0.05
    pool: int = 4
    tls: bool = False
    ca: str = ""
    server_name: str = ""
    data: str = "kv"
    # data=nixl: the registration cache's byte bound per lane (least recently used revoked).
    nixl_cache_bytes: int = 1 << 30

    @classmethod
    def from_url(cls, url: StoreURL) -> NativeOptions:
        """Raises: ConfigError: unknown parameter or bad value."""
        params = url.take(_PARAMS)
        kwargs: dict[str, Any] = {"host": url.host or "127.0.0.1", "port": url.port or DEFAULT_PORT}
        kwargs |= typed_params(
            "kv://",
            params,
            floats=("timeout", "connect_timeout", "backoff"),
            ints={"retries": "retries", "pool": "pool", "nixl_cache_bytes": "nixl_cache_bytes"},
            flags=("tls", "legacy_token"),
        )
        for name in ("token", "tenant", "node", "ca", "server_name", "data"):
            if name in params:
                kwargs[name] = params[name]
        options = cls(**kwargs)
        if options.timeout <= 0 or options.connect_timeout <= 0 or options.backoff < 0:
            raise ConfigError("kv:// timeouts must be positive and backoff non-negative")
        if options.data not in _DATA_PATHS:
            raise ConfigError(f"kv:// data must be one of {', '.join(_DATA_PATHS)}")
        if options.retries < 0 or options.pool < 1:
            raise ConfigError("kv:// retries must be >= 0 and pool >= 1")
        if options.nixl_cache_bytes < 1:
            raise ConfigError("kv:// nixl_cache_bytes must be >= 1")
        return options

    @property
    def url(self) -> str:
        return f"kv://{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        try:
            return ssl.create_default_context(cafile=self.ca or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load CA file {self.ca!r}: {exc}") from None
