"""The client SDK: block keys, `Client` / `AsyncClient` and the transports behind them."""

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
from kvoffload.client_sdk.seal import SealKeys
from kvoffload.client_sdk.transports.local import LocalTransport
from kvoffload.wire.blockmeta import BlockMeta
from kvoffload.wire.tiers import Tier, TierRun

__all__ = [
    "AsyncClient",
    "BlockHash",
    "BlockKey",
    "BlockMeta",
    "Client",
    "ClientStats",
    "LocalTransport",
    "Namespace",
    "SealKeys",
    "Tier",
    "TierRun",
    "block_hashes",
    "block_keys",
    "engine_hashes",
    "engine_keys",
]
