"""Transports: how the SDK reaches a store. One registry, scheme -> lazy factory."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from kvoffload.client_sdk.transports.base import AsyncTransport, HeldBlock, Transport
from kvoffload.client_sdk.url import StoreURL
from kvoffload.errors import ConfigError

__all__ = ["AsyncTransport", "HeldBlock", "Transport", "open_transport", "register_scheme"]

# scheme -> "module:function(StoreURL) -> Transport"; imported only when a URL asks for it.
_SCHEMES: dict[str, str] = {
    "local": "kvoffload.client_sdk.transports.local:open_local",
}


def register_scheme(scheme: str, target: str) -> None:
    """Register a transport factory ("module:function") for URLs of `scheme`."""
    if scheme in _SCHEMES:
        raise ConfigError(f"URL scheme {scheme!r} is already registered")
    _SCHEMES[scheme] = target


def open_transport(url: StoreURL) -> Transport:
    """Open the transport that serves `url`.

    Raises:
        ConfigError: no transport serves the scheme, or its parameters are wrong.
    """
    target = _SCHEMES.get(url.scheme)
    if target is None:
        raise ConfigError(
            f"unknown URL scheme {url.scheme!r}; supported: "
            + ", ".join(f"{s}://" for s in sorted(_SCHEMES))
        )
    module, _, name = target.partition(":")
    factory = cast(Callable[[StoreURL], Transport], getattr(importlib.import_module(module), name))
    return factory(url)
