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
