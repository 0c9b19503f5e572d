"""Tenants: authentication at Hello and per-tenant key spaces over one engine.

A client proves it holds its tenant's secret by challenge–response (`wire.hello_auth`): this
node holds, per tenant, only its own key ``K_node = KDF(secret, node id)`` (configured as
`node_key`, or derived here from the configured `token`), so what a client sends it cannot be
replayed elsewhere. The old Hello that carries the token itself is accepted only with
`native.token_hello`.

A tenant's keys are mixed with its name before they reach the engine
(``blake3("kvoffload tenant\\0" ‖ name ‖ "\\0" ‖ key)[:16]``), so two tenants that put the same
block key store two different blocks, and no key one tenant can send names another's block.
With no tenants configured the store is open: one anonymous tenant whose keys are used as they
are (so a single-user store costs no hashing).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field

from blake3 import blake3

from kvoffload.errors import AuthError, ConfigError, InvalidArgumentError
from kvoffload.kvstore import Engine
from kvoffload.nvmeof_target.config import TenantConfig
from kvoffload.wire.hello_auth import (
    client_proof,
    new_nonce,
    node_key,
    parse_node_key,
    server_proof,
)

__all__ = ["ANONYMOUS", "HelloChallenge", "Tenant", "Tenants"]


@dataclass(frozen=True)
class Tenant:
    """Who a connection is; maps its keys into the engine's key space."""

    name: str
    _prefix: blake3 | None = field(default=None, repr=False, compare=False)

    @classmethod
    def named(cls, name: str) -> Tenant:
        return cls(name, blake3(b"kvoffload tenant\0" + name.encode() + b"\0"))

    def key(self, key: bytes) -> bytes:
        """The engine key of this tenant's `key`."""
        if self._prefix is None:
            return key
        hasher = self._prefix.copy()
        hasher.update(key)
        digest: bytes = hasher.digest(length=16)
        return digest

    @property
    def hasher(self) -> blake3 | None:
        """The keyed hasher `key` copies (None: keys pass unchanged), for a C key derivation
        that must give the same keys (`kvoffload/core/hot.c`)."""
        return self._prefix

    def keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return [self.key(k) for k in keys] if self._prefix is not None else list(keys)

    def opt_key(self, key: bytes | None) -> bytes | None:
        return None if key is None else self.key(key)


ANONYMOUS = Tenant("")


@dataclass(frozen=True)
class HelloChallenge:
    """A Challenge this node sent, waiting for the client's Auth."""

    tenant: str  # as the Hello named it ("" = whichever tenant's key made the proof)
    client_nonce: bytes
    node_nonce: bytes
    version: int  # the Hello's protocol version


class Tenants:
    """The configured tenants; `challenge` and `answer` (or, for the old Hello,
    `authenticate`) turn a connection's credentials into a `Tenant`."""

    def __init__(self, configs: Sequence[TenantConfig], node: str = "") -> None:
        self._configs = tuple(configs)
        self._tenants = {c.name: Tenant.named(c.name) for c in configs}
        self.node = node  # the node id clients derive this node's keys for
        self._keys = {
            c.name: parse_node_key(c.node_key) if c.node_key else node_key(c.token, node)
            for c in configs
        }

    @property
    def open(self) -> bool:
        """True when no tenants are configured (no token needed)."""
        return not self._configs

    def apply_quotas(self, engine: Engine) -> None:
        """Set every tenant's quotas on `engine`.

        Raises:
            ConfigError: an SSD quota for a store without an SSD tier.
        """
        for config in self._configs:
            try:
                engine.set_quota(
                    config.name,
                    config.quota_bytes or None,
                    ssd_bytes=config.ssd_quota_bytes or None,
                )
            except InvalidArgumentError as exc:
                raise ConfigError(f"tenants.{config.name}: {exc}") from exc

    def named(self, name: str) -> Tenant:
        """The tenant called `name` ("" = the open store's anonymous key space).

        Raises:
            ConfigError: no such tenant is configured.
        """
        if not name:
            return ANONYMOUS
        found = self._tenants.get(name)
        if found is None:
            raise ConfigError(f"unknown tenant {name!r}; configured: {sorted(self._tenants)}")
        return found

    def challenge(self, tenant: str, client_nonce: bytes, version: int) -> HelloChallenge:
        """A fresh Challenge for a Hello that named `tenant` ("" = any). An unknown name gets
        one too, and fails at `answer` like a wrong proof: names are not revealed.

        Raises:
            AuthError: no tenants are configured (an open store takes no credentials).
        """
        if self.open:
            raise AuthError("this store has no tenants configured; connect without a token")
        return HelloChallenge(tenant, client_nonce, new_nonce(), version)

    def answer(
        self, pending: HelloChallenge, proof: bytes, binding: bytes = b""
    ) -> tuple[Tenant, bytes]:
        """The tenant whose key made `proof`, and this node's proof for its Welcome;
        `binding`: `tls_binding` of this node's certificate on a TLS connection, else b"".

        Raises:
            AuthError: no tenant's key made it (a wrong secret, another node's key, a proof
                made for another connection's nonces, or the name of another tenant).
        """
        found = ""
        # Every key, each compared in constant time, so timing reveals nothing.
        for name, key in self._keys.items():
            expected = client_proof(
                key, pending.tenant, self.node, pending.client_nonce, pending.node_nonce, binding
            )
            if hmac.compare_digest(expected, proof) and pending.tenant in ("", name):
                found = name
        if not found:
            raise AuthError("invalid credentials: the proof matches no tenant's key on this node")
        mine = server_proof(
            self._keys[found], found, self.node, pending.client_nonce, pending.node_nonce, binding
        )
        return self._tenants[found], mine

    def authenticate(self, token: str) -> Tenant:
        """The tenant that owns `token` (the old Hello; tenants configured with a `node_key`
        only cannot be reached this way).

        Raises:
            AuthError: no tenant has this token (or a token was given to an open store).
        """
        if self.open:
            if token:
                raise AuthError("this store has no tenants configured; connect without a token")
            return ANONYMOUS
        found = None
        for config in self._configs:
            # Compare against every token, in constant time each, so timing reveals nothing.
            if config.token and hmac.compare_digest(config.token.encode(), token.encode()):
                found = self._tenants[config.name]
        if found is None:
            raise AuthError("invalid token" if token else "this store requires a token")
        return found
