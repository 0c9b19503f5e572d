"""ZMQ CURVE for the KV events publisher and replay endpoint (`events.curve_*` keys).

Token ids in the events are prompt content. With CURVE the sockets encrypt, and only clients
whose public key is allowed connect: a ZAP handler (pyzmq's `ThreadAuthenticator`) on a ZMQ
context of the events' own checks every handshake, so a client with another key gets nothing.
The context is the events' own because a context has one ZAP handler.

A tenant's own endpoints (`tenants.<name>.events`) share the daemon's key pair but not its
allow list: each of their sockets has the ZAP domain ``tenant/<name>``, which admits only the
keys of that tenant's `curve_clients`, so a router allowed one tenant cannot connect to
another's endpoints, nor to the shared ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.config import EventsConfig

__all__ = ["Curve", "allowed_keys"]


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"events: cannot read the CURVE key file {path}: {exc}") from None


def allowed_keys(location: str) -> set[bytes]:
    """The Z85 public keys in a key file, or in every ``*.key``/``*.key_secret`` file of a
    directory.

    Raises:
        ConfigError: missing, unreadable, or holding no key.
    """
    path = Path(location)
    if path.is_dir():
        files = sorted([*path.glob("*.key"), *path.glob("*.key_secret")])
    elif path.exists():
        files = [path]
    else:
        raise ConfigError(f"events: curve_clients {location} does not exist")
    keys = {_load(f)[0] for f in files}
    if not keys:
        raise ConfigError(f"events: curve_clients {location} holds no public key")
    return keys


class _Allowed:
    """One ZAP domain's allow list (pyzmq calls `callback` per handshake)."""

    def __init__(self, keys: set[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether a client's public key (Z85, as pyzmq passes it) is allowed."""
        return key in self._keys


def domain_of(tenant: str) -> str:
    """The ZAP domain of a tenant's own sockets ("" for the shared ones)."""
    return f"tenant/{tenant}" if tenant else ""


class Curve:
    """The server side: a context with a ZAP handler allowing `curve_clients` on the shared
    sockets and each tenant's own clients on its sockets, and the keys each bound socket is
    given (`secure`)."""

    def __init__(self, config: EventsConfig, tenants: Mapping[str, str] | None = None) -> None:
        """`tenants`: tenant name -> its `curve_clients`, for the tenants with endpoints of
        their own.

        Raises:
        ConfigError: libzmq was built without CURVE, or a key file is missing or bad."""
        if not zmq.has("curve"):
            raise ConfigError(
                "events: CURVE is configured but this libzmq was built without it "
                "(zmq.has('curve') is False); install a pyzmq wheel with libsodium/CURVE"
            )
        public, secret = _load(Path(config.curve_secret_key_file))
        if secret is None:
            raise ConfigError(
                f"events: {config.curve_secret_key_file} holds no secret key (give the "
                "server's .key_secret file)"
            )
        self._public, self._secret = public, secret
        # pyzmq's authenticator reads an empty domain as "*".
        domains = {"*": _Allowed(allowed_keys(config.curve_clients))}
        for tenant, clients in (tenants or {}).items():
            domains[domain_of(tenant)] = _Allowed(allowed_keys(clients))
        self.context: zmq.Context[Any] = zmq.Context()
        self._auth = ThreadAuthenticator(self.context)
        self._auth.start()
        for domain, allowed in domains.items():
            self._auth.configure_curve_callback(domain, credentials_provider=allowed)

    def secure(self, socket: zmq.Socket[bytes], tenant: str = "") -> None:
        """Make `socket` a CURVE server (before it binds) admitting the shared clients, or
        `tenant`'s own."""
        socket.curve_secretkey = self._secret
        socket.curve_publickey = self._public
        socket.curve_server = True
        if tenant:
            socket.zap_domain = domain_of(tenant).encode()

    def close(self) -> None:
        """After the sockets of `context` are closed."""
        self._auth.stop()
        self.context.term()
