"""Transports: how the SDK reaches a store. One registry, scheme -> lazy factory."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from kvoffload.client_sdk.transports.base import (
    AsyncTransport,
    HeldBlock,
    ThreadedAsyncTransport,
    Transport,
)
from kvoffload.client_sdk.url import StoreURL
from kvoffload.errors import ConfigError

__all__ = [
    "AsyncTransport",
    "HeldBlock",
    "Transport",
    "open_async_transport",
    "open_transport",
    "register_scheme",
]

# scheme -> "module:function(StoreURL) -> Transport"; imported only when a URL asks for it.
_SCHEMES: dict[str, str] = {
    "local": "kvoffload.client_sdk.transports.local:open_local",
    "kv": "kvoffload.client_sdk.transports.native.shards:open_sharded",
    "nvme+tcp": "kvoffload.client_sdk.transports.nvme:open_nvme",
    "cluster": "kvoffload.client_sdk.transports.cluster:open_cluster",
    "cluster+etcd": "kvoffload.client_sdk.transports.cluster:open_cluster",
    "cluster+etcds": "kvoffload.client_sdk.transports.cluster:open_cluster",
}
# scheme -> "module:function(StoreURL) -> AsyncTransport" for schemes with an asyncio
# transport; the others are served from their sync transport in a worker thread.
_ASYNC_SCHEMES: dict[str, str] = {
    "kv": "kvoffload.client_sdk.transports.native.shards:open_sharded_async",
    "cluster": "kvoffload.client_sdk.transports.cluster:open_cluster_async",
    "cluster+etcd": "kvoffload.client_sdk.transports.cluster:open_cluster_async",
    "cluster+etcds": "kvoffload.client_sdk.transports.cluster:open_cluster_async",
}


def register_scheme(scheme: str, target: str, async_target: str | None = None) -> None:
    """Register transport factories ("module:function") for URLs of `scheme`."""
    if scheme in _SCHEMES:
        raise ConfigError(f"URL scheme {scheme!r} is already registered")
    _SCHEMES[scheme] = target
    if async_target is not None:
        _ASYNC_SCHEMES[scheme] = async_target


def _load(target: str) -> Callable[[StoreURL], object]:
    module, _, name = target.partition(":")
    return cast(Callable[[StoreURL], object], getattr(importlib.import_module(module), name))


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
    return cast(Transport, _load(target)(url))


def open_async_transport(url: StoreURL) -> AsyncTransport:
    """The asyncio transport that serves `url`.

    Raises:
        ConfigError: no transport serves the scheme, or its parameters are wrong.
    """
    target = _ASYNC_SCHEMES.get(url.scheme)
    if target is not None:
        return cast(AsyncTransport, _load(target)(url))
    return ThreadedAsyncTransport(open_transport(url))
