"""Batched puts and gets larger than the daemon's DRAM tier behave as the engine's own do."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload.client_sdk import Client
from kvoffload.errors import CapacityError

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


def test_a_put_many_failing_after_early_commits_counts_the_bytes_it_stored(
    start_daemon: Start,
) -> None:
    # A tenant quota of 2 MiB: the batch's received values fill it, the daemon commits them to
    # make room (they stay stored), then the last value fails: alone it exceeds the quota.
    config = '[tenants.alice]\ntoken = "t"\nquota_bytes = "2MiB"\n'
    daemon = start_daemon("--dram", "64MiB", config=config)
    keys = [i.to_bytes(16, "big") for i in range(1, 18)]
    values = [bytes(BLOCK)] * 16 + [bytes(3 << 20)]
    with Client.connect(daemon.url(token="t")) as client:
        client.put(bytes(16), bytes(BLOCK))  # what one value sends, framing included
        one = _bytes_in(daemon)
        with pytest.raises(CapacityError):
            client.put_many(zip(keys, values, strict=True))
        stored = client.stats().store["puts"]
    assert stored > 1
    assert _bytes_in(daemon) == one * stored  # 1 * one before: the early commits went uncounted


def _bytes_in(daemon: Any) -> float:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    (line,) = [s for s in text.splitlines()
               if s.startswith('kvoffload_payload_bytes_in_total{front="native"} ')]  # fmt: skip
    return float(line.split()[-1])
