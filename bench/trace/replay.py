"""Replay a trace through the SDK: per request, look up its block chain, load the hits, then
store the blocks it had to compute.

Every block's payload is a fixed random template with the block's key written into its first
and last 16 bytes, so a load can be checked bit for bit against what was stored, and a block
served under the wrong key cannot pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvoffload.client_sdk import BlockKey, Client, TierRun
from kvoffload.errors import CorruptBlockError, InvalidArgumentError

__all__ = ["Payloads", "ReplayResult", "replay", "tier_hits"]

KEY = 16


class Payloads:
    """Deterministic block payloads of `size` bytes, one per key."""

    def __init__(self, size: int, seed: int = 0) -> None:
        if size < 2 * KEY:
            raise InvalidArgumentError(f"block payloads need at least {2 * KEY} bytes, got {size}")
        self.size = size
        self.template: npt.NDArray[np.uint8] = np.random.default_rng(seed).integers(
            0, 256, size, dtype=np.uint8
        )
        self._scratch: npt.NDArray[np.uint8] = self.template.copy()

    def of(self, key: bytes) -> npt.NDArray[np.uint8]:
        """The payload of `key` (a scratch buffer, valid until the next call)."""
        stamp = np.frombuffer(key, dtype=np.uint8)
        self._scratch[:KEY] = stamp
        self._scratch[-KEY:] = stamp
        return self._scratch

    def fresh(self, key: bytes) -> npt.NDArray[np.uint8]:
        """The payload of `key` in a new array (for threads, and batches that hold several)."""
        out: npt.NDArray[np.uint8] = self.template.copy()
        stamp = np.frombuffer(key, dtype=np.uint8)
        out[:KEY] = stamp
        out[-KEY:] = stamp
        return out

    def matches(self, key: bytes, got: npt.NDArray[np.uint8]) -> bool:
        """Whether `got` is, byte for byte, the payload of `key`."""
        stamp = np.frombuffer(key, dtype=np.uint8)
        body = slice(KEY, self.size - KEY)
        return (
            bool(np.array_equal(got[:KEY], stamp))
            and bool(np.array_equal(got[-KEY:], stamp))
            and bool(np.array_equal(got[body], self.template[body]))
        )


@dataclass
class ReplayResult:
    """Per-request outcomes of one replay (arrays in request order) and its totals."""

    prompt_tokens: npt.NDArray[np.int64]
    hit_blocks: npt.NDArray[np.int64]  # leading blocks loaded (and verified)
    stored_blocks: npt.NDArray[np.int64]
    ssd_hits: npt.NDArray[np.int64]  # of hit_blocks, how many came from the SSD tier
    load_s: npt.NDArray[np.float64]  # lookup + get_into of the hits
    store_s: npt.NDArray[np.float64]
    block_tokens: int
    payload_bytes: int
    wall_s: float
    verified_blocks: int
    client_stats: dict[str, object] = field(default_factory=dict)
    # Per request, the loaded hit blocks by tier as the lookup reported them (key order).
    tier_runs: list[TierRun] = field(default_factory=list)

    @property
    def hit_tokens(self) -> npt.NDArray[np.int64]:
        return self.hit_blocks * self.block_tokens

    @property
    def computed_tokens(self) -> npt.NDArray[np.int64]:
        return self.prompt_tokens - self.hit_tokens

    @property
    def total_hit_tokens(self) -> int:
        return int(self.hit_tokens.sum())

    @property
    def hit_ratio(self) -> float:
        total = int(self.prompt_tokens.sum())
        return self.total_hit_tokens / total if total else 0.0

    @property
    def bytes_read(self) -> int:
        return int(self.hit_blocks.sum()) * self.payload_bytes

    @property
    def bytes_written(self) -> int:
        return int(self.stored_blocks.sum()) * self.payload_bytes

    @property
    def time_per_request_s(self) -> npt.NDArray[np.float64]:
        return self.load_s + self.store_s


def tier_hits(client: Client) -> int:
    """SSD-tier hits the store has counted so far (0 for a store without one)."""
    tiers = client.stats().store.get("tiers", ())
    if isinstance(tiers, (list, tuple)) and len(tiers) > 1 and isinstance(tiers[1], dict):
        return int(tiers[1].get("hits", 0))
    return 0


def replay(
    client: Client,
    chains: Sequence[Sequence[BlockKey]],
    prompt_tokens: Sequence[int] | npt.NDArray[np.int64],
    payloads: Payloads,
    *,
    block_tokens: int,
    count_ssd_hits: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay requests in order against `client` (a fresh store, ideally).

    For request i: `lookup(chains[i])`; `get_into` each hit block in chain order, verifying it
    bit for bit; the first block that does not come back ends the hit; then `put` every
    remaining block of the chain with its parent key (so the prefix-aware policy sees the
    chain). Load and store times are measured without the verification.

    Raises:
        CorruptBlockError: a loaded block differs from what was stored under its key.
    """
    n = len(chains)
    hits = np.zeros(n, dtype=np.int64)
    stored = np.zeros(n, dtype=np.int64)
    ssd = np.zeros(n, dtype=np.int64)
    load_s = np.zeros(n, dtype=np.float64)
    store_s = np.zeros(n, dtype=np.float64)
    buf = np.empty(payloads.size, dtype=np.uint8)
    verified = 0
    runs: list[TierRun] = []
    ssd_before = tier_hits(client) if count_ssd_hits else 0
    start = time.perf_counter()
    for i, keys in enumerate(chains):
        t0 = time.perf_counter()
        run = client.lookup(keys, tiers=True)  # as cheap as the plain lookup
        found = run.total
        spent = time.perf_counter() - t0
        loaded = 0
        for key in keys[:found]:
            t1 = time.perf_counter()
            got = client.get_into(key, buf)
            spent += time.perf_counter() - t1
            if got != payloads.size:
                break  # gone since the lookup (or failed its checksum): the hit ends here
            if not payloads.matches(key, buf):
                raise CorruptBlockError(
                    f"request {i}: block {key.hex()} came back with different bytes"
                )
            verified += 1
            loaded += 1
        load_s[i] = spent
        t2 = time.perf_counter()
        for j in range(loaded, len(keys)):
            client.put(keys[j], payloads.of(keys[j]), parent=keys[j - 1] if j else None)
        store_s[i] = time.perf_counter() - t2
        hits[i], stored[i] = loaded, len(keys) - loaded
        runs.append(run.slice(0, loaded))
        if count_ssd_hits:
            now = tier_hits(client)
            ssd[i], ssd_before = now - ssd_before, now
        if progress is not None:
            progress(1)
    wall = time.perf_counter() - start
    return ReplayResult(
        prompt_tokens=np.asarray(prompt_tokens, dtype=np.int64),
        hit_blocks=hits,
        stored_blocks=stored,
        ssd_hits=ssd,
        load_s=load_s,
        store_s=store_s,
        block_tokens=block_tokens,
        payload_bytes=payloads.size,
        wall_s=wall,
        verified_blocks=verified,
        client_stats=client.stats().as_dict(),
        tier_runs=runs,
    )
