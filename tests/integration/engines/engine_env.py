"""Shared by the serving-engine suites, each of which runs in a virtual environment of its own.

The suites are not collected by the main suite (``norecursedirs``); `.ci/engines.sh vllm`
(or sglang, lmcache) builds an engine's environment and runs its tests there.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

# LMCache posts usage telemetry by default; nothing here may reach the network.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def require_engine(module: str, env: str) -> ModuleType:
    """Import an engine package for its suite.

    Without the package the suite is skipped, unless `env` is set (as `.ci/engines.sh` does in
    the environment that installs the engine): then a missing package is an import error, so
    a broken install can never pass as skipped tests.
    """
    if os.environ.get(env):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed ({env}=1 in CI)")


def damage_stored_block(url: str, key: bytes, offset: int = -1) -> None:
    """Flip one bit of a stored block's payload behind the SDK's back (through the raw
    transport, so the block header still describes the old bytes)."""
    from kvoffload.client_sdk import Client

    with Client.connect(url) as raw:
        held = raw.transport.get(key[:16])
        assert held is not None, "the block to damage is not stored"
        damaged = bytearray(held.data)
        held.release()
        damaged[offset] ^= 0x10
        raw.transport.put(key[:16], [bytes(damaged)], None)
