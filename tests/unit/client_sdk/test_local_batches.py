"""local:// batched gets of more SSD blocks than DRAM holds: bounded side buffers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from kvoffload.client_sdk import AsyncClient, Client

BLOCK = 256 << 10
N = 96  # 24 MiB of blocks on the SSD, a 4 MiB DRAM tier (about 15 of them)
WINDOW = 16  # the most side buffers a local:// batch may hold (LocalTransport.hold_window)


def _fill(client: Client) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(7)
    keys = [i.to_bytes(16, "big") for i in range(1, N + 1)]
    values = [rng.integers(0, 255, BLOCK, dtype=np.uint8) for _ in range(N)]
    client.put_many(zip(keys, values, strict=True))
    return keys, values


def _staged_of(store: dict[str, object]) -> tuple[int, int]:
    staged, peak = store["staged_gets"], store["staged_peak"]
    assert isinstance(staged, int) and isinstance(peak, int)
    return staged, peak


def _staged(client: Client) -> tuple[int, int]:
    return _staged_of(client.stats().store)


def test_get_many_into_of_more_ssd_blocks_than_dram_holds_few_side_buffers(
    tmp_path: Path,
) -> None:
    with Client.connect(f"local://{tmp_path}?dram=4MiB&ssd=64MiB&admit=1") as client:
        keys, values = _fill(client)
        buffers = [np.empty(BLOCK, dtype=np.uint8) for _ in keys]
        assert client.get_many_into(keys, buffers) == [BLOCK] * N
        assert all(np.array_equal(b, v) for b, v in zip(buffers, values, strict=True))
        got = client.get_many(keys)
        assert all(g == v.tobytes() for g, v in zip(got, values, strict=True))
        staged, peak = _staged(client)
        assert staged > 0  # DRAM did run out: the bound below is the one under test
        assert peak <= WINDOW  # held all at once before: N less what DRAM holds (~80)


def test_async_get_many_into_holds_few_side_buffers(tmp_path: Path) -> None:
    with Client.connect(f"local://{tmp_path}?dram=4MiB&ssd=64MiB&admit=1") as client:
        keys, values = _fill(client)
    buffers = [np.empty(BLOCK, dtype=np.uint8) for _ in keys]

    async def main() -> tuple[list[int | None], list[bytes | None], dict[str, object]]:
        async with AsyncClient.connect(f"local://{tmp_path}?dram=4MiB") as client:
            into = await client.get_many_into(keys, buffers)
            got = await client.get_many(keys)
            return into, got, (await client.stats()).store

    into, got, store = asyncio.run(main())
    assert into == [BLOCK] * N
    assert all(np.array_equal(b, v) for b, v in zip(buffers, values, strict=True))
    assert all(g == v.tobytes() for g, v in zip(got, values, strict=True))
    staged, peak = _staged_of(store)
    assert staged > 0 and peak <= WINDOW
