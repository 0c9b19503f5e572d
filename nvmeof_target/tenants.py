"""Tenants: token authentication and per-tenant key spaces over one engine.

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

__all__ = ["ANONYMOUS", "Tenant", "Tenants"]


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

    def keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return [self.key(k) for k in keys] if self._prefix is not None else list(keys)

    def opt_key(self, key: bytes | None) -> bytes | None:
        return None if key is None else self.key(key)


ANONYMOUS = Tenant("")


class Tenants:
    """The configured tenants; `authenticate` turns a token into a `Tenant`."""

    def __init__(self, configs: Sequence[TenantConfig]) -> None:
        self._configs = tuple(configs)
        self._tenants = {c.name: Tenant.named(c.name) for c in configs}

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

    def authenticate(self, token: str) -> Tenant:
        """The tenant that owns `token`.

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
            if hmac.compare_digest(config.token.encode(), token.encode()):
                found = self._tenants[config.name]
        if found is None:
            raise AuthError("invalid token" if token else "this store requires a token")
        return found
