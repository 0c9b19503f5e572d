"""The SSD tier at the issue's scale: 1 GiB DRAM + 8 GiB SSD through the SDK's local:// URL."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from kvoffload.client_sdk import Client

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 2 << 20
BLOCKS = 768  # 1.5 GiB: half again the DRAM tier


def value(base: np.ndarray, i: int) -> np.ndarray:
    v = base.copy()
    v[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    v[-8:] = v[:8]
    return v


def test_working_set_larger_than_dram_survives_restart(tmp_path: Path) -> None:
    if shutil.disk_usage(tmp_path).free < 12 << 30:
        pytest.skip("needs 12 GiB of free disk for an 8 GiB SSD tier (a resource, not a feature)")
    url = f"local://{tmp_path}/store?dram=1GiB&ssd=8GiB&admit=1"
    base = np.frombuffer(np.random.default_rng(0).bytes(BLOCK), np.uint8)
    keys = [i.to_bytes(16, "little") for i in range(BLOCKS)]
    out = np.empty(BLOCK, np.uint8)
    with Client.connect(url) as client:
        for i, k in enumerate(keys):
            client.put(k, value(base, i), parent=keys[i - 1] if i else None)
        assert client.lookup(keys) == BLOCKS
        for i, k in enumerate(keys):
            assert client.get_into(k, out) == BLOCK and np.array_equal(out, value(base, i))
        dram, ssd = client.stats().store["tiers"]  # type: ignore[misc]
        assert dram["capacity_bytes"] == 1 << 30 and dram["demotions"] > 0
        assert ssd["hits"] > 0 and ssd["corrupt_blocks"] == 0
    with Client.connect(url) as client:  # restart: everything comes back from the SSD
        assert client.lookup(keys) == BLOCKS
        for i, k in enumerate(keys):
            assert client.get_into(k, out) == BLOCK and np.array_equal(out, value(base, i))
        assert client.stats().corrupt_blocks == 0
