"""The client SDK: block keys, `Client` / `AsyncClient`, transports and the wire formats.

Exports resolve lazily (PEP 562) so that importing `kvoffload.client_sdk.wire` — as the daemon
does — does not pull in the transports or the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.client_sdk.client import AsyncClient, Client
    from kvoffload.client_sdk.keys import (
        BlockHash,
        BlockKey,
        Namespace,
        block_hashes,
        block_keys,
        engine_hashes,
        engine_keys,
    )
    from kvoffload.client_sdk.request_layer import ClientStats
    from kvoffload.client_sdk.wire.blockmeta import BlockMeta
    from kvoffload.client_sdk.wire.tiers import Tier, TierRun

__all__ = [
    "AsyncClient",
    "BlockHash",
    "BlockKey",
    "BlockMeta",
    "Client",
    "ClientStats",
    "Namespace",
    "Tier",
    "TierRun",
    "block_hashes",
    "block_keys",
    "engine_hashes",
    "engine_keys",
]

_HOME = {
    "AsyncClient": "client",
    "Client": "client",
    "ClientStats": "request_layer",
    "BlockHash": "keys",
    "BlockKey": "keys",
    "BlockMeta": "wire.blockmeta",
    "Namespace": "keys",
    "Tier": "wire.tiers",
    "TierRun": "wire.tiers",
    "block_hashes": "keys",
    "block_keys": "keys",
    "engine_hashes": "keys",
    "engine_keys": "keys",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
