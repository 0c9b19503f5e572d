"""Batched puts and gets larger than the daemon's DRAM tier behave as the engine's own do."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload.client_sdk import Client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

Start = Callable[..., Any]  # the `start_daemon` fixture (conftest.py) -> Daemon

BLOCK = 256 << 10
BATCH = 160  # 40 MiB in one frame (the client's budget is 256 MiB), into a 16 MiB arena


def _batch(seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [bytes([seed]) + i.to_bytes(15, "big") for i in range(BATCH)]
    return keys, [rng.integers(0, 255, BLOCK, dtype=np.uint8) for _ in range(BATCH)]


@pytest.mark.parametrize("ssd", ["0", "256MiB"])
def test_a_put_many_larger_than_dram_stores_what_fits_like_the_engine(
    start_daemon: Start, tmp_path: Path, ssd: str
) -> None:
    keys, values = _batch(1)
    url_params = f"?dram=16MiB&ssd={ssd}" if ssd != "0" else "?dram=16MiB"
    with Client.connect(f"local://{tmp_path / 'local'}{url_params}") as local:
        local.put_many(zip(keys, values, strict=True))  # the engine's own: evicts as it goes
        engine_hits = [local.get(k) is not None for k in keys]
    daemon = start_daemon("--dram", "16MiB", "--ssd", ssd)
    with Client.connect(daemon.url()) as client:
        client.put_many(zip(keys, values, strict=True))  # raised CapacityError before
        got = client.get_many(keys)
        for value, stored in zip(got, values, strict=True):
            assert value is None or value == stored.tobytes()
        hits = [v is not None for v in got]
        assert hits[-1] and sum(hits) >= 32  # the newest blocks, a DRAM's worth at least
        if ssd != "0":
            assert all(hits) and all(engine_hits)  # the rest were demoted, not lost
        assert client.stats().store["puts"] == BATCH
