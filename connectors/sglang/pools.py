"""One HiCache v2 pool's pages in the store (SGLang 0.5.23): their keys, their host memory, and
which prefix lengths they can restore under SGLang's hit policies."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy

from kvoffload.client_sdk import BlockHash, Client, engine_hashes
from kvoffload.errors import ConfigError

__all__ = ["PoolPages", "host_memory", "probe_parts", "restorable"]

# Reads one verified block into a buffer; False for a miss or a failed read.
Reader = Callable[[Client, BlockHash, Any], bool]

# What a host pool raises when it cannot report a page's buffers (Mamba pools with slot side
# states, layer-first Mamba pools): such a pool is stored as one flat page instead.
_NO_PARTS = (NotImplementedError, ValueError, AssertionError, AttributeError)


def host_memory(ptr: int, size: int) -> memoryview:
    """Writable bytes of host memory SGLang's pool reported (pinned CPU memory it owns)."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def probe_parts(pool: Any) -> tuple[bool, list[int]]:
    """(zero copy, byte size of each part of one page) for a host pool."""
    page = torch.arange(int(getattr(pool, "page_size", 1) or 1), dtype=torch.int64)
    try:
        _, sizes = pool.get_page_buffer_meta(page)
    except _NO_PARTS:
        flat = pool.get_dummy_flat_data_page()
        return False, [int(flat.numel() * flat.element_size())]
    return True, [int(s) for s in sizes]


def restorable(policy: Any, window: int, present: Sequence[bool]) -> set[int]:
    """The prefix lengths (in pages, 1..len(present)) a pool can restore.

    `present[i]`: page i's parts are all stored. ALL_PAGES needs every page of the prefix,
    TRAILING_PAGES only its last `window` pages (a Mamba state: the last one).

    Raises:
        ValueError: a policy this backend does not fold (BLOCK_GROUPS gives no verdict).
    """
    policy = PoolHitPolicy(policy)
    if policy == PoolHitPolicy.ALL_PAGES:
        boundary = next((i for i, ok in enumerate(present) if not ok), len(present))
        return set(range(1, boundary + 1))
    if policy == PoolHitPolicy.TRAILING_PAGES:
        window = max(1, window)
        return {n for n in range(1, len(present) + 1) if all(present[max(0, n - window) : n])}
    raise ValueError(f"hit policy {policy.value!r} is not folded into the KV hit")


class PoolPages:
    """How one host pool's pages are stored: a page of the pool named `name` is kept as the
    parts its host pool reports for it (zero copy), or as one flat page where the pool cannot
    report them; each part is its own block, verified on its own when read.

    Args:
        name: SGLang's pool name (``mamba``, ``swa``, ...).
        pool: the host pool SGLang registered under that name.
        client: a client whose namespace names this pool's kind and layout.
        zero_copy, part_sizes: what `probe_parts` found.
    """

    def __init__(
        self, name: str, pool: Any, client: Client, zero_copy: bool, part_sizes: list[int]
    ) -> None:
        self.name = name
        self.pool = pool
        self.client = client
        self.zero_copy = zero_copy
        self.part_sizes = part_sizes
        self.parts = len(part_sizes)
        self.page_size = int(getattr(pool, "page_size", 1) or 1)

    def hashes(self, keys: Sequence[str]) -> list[BlockHash]:
        """One hash per part per page, page after page."""
        ns = self.client.namespace
        assert ns is not None  # every pool client is built with its namespace
        names = [f"{key}\0v2/{self.name}/{j}".encode() for key in keys for j in range(self.parts)]
        return engine_hashes(ns, names)

    # -- lookups --------------------------------------------------------------------------

    def leading(self, keys: Sequence[str]) -> int:
        """How many leading pages of `keys` have every part stored (one round trip)."""
        return self.client.lookup(self.hashes(keys)) // self.parts

    def present(self, keys: Sequence[str], pool: ThreadPoolExecutor) -> list[bool]:
        """Per page of `keys`: every part stored. One lookup for the leading run, then one
        per remaining page (a trailing-state pool holds states only at some boundaries)."""
        hashes = self.hashes(keys)
        run = self.client.lookup(hashes) // self.parts
        parts = self.parts

        def page(i: int) -> bool:
            return self.client.lookup(hashes[i * parts : (i + 1) * parts]) == parts

        rest = list(pool.map(page, range(run + 1, len(keys))))
        return [True] * run + [False] * (run < len(keys)) + rest

    # -- transfers ------------------------------------------------------------------------

    def _offsets(self, host_indices: torch.Tensor, pages: int) -> list[int]:
        if host_indices is None or int(host_indices.numel()) != pages * self.page_size:
            got = 0 if host_indices is None else int(host_indices.numel())
            raise ConfigError(
                f"pool {self.name}: {pages} pages need {pages * self.page_size} host indices, "
                f"got {got}"
            )
        return [int(v) for v in host_indices.tolist()[:: self.page_size]]

    def _memory(self, host_indices: torch.Tensor, pages: int) -> list[memoryview]:
        self._offsets(host_indices, pages)
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if [int(s) for s in sizes] != self.part_sizes * pages:
            raise ConfigError(
                f"pool {self.name}: the host pool reported buffers of {list(sizes)} bytes for "
                f"{pages} pages, expected {self.part_sizes} per page"
            )
        return [host_memory(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]

    def values(self, host_indices: torch.Tensor, pages: int) -> list[Any]:
        """What to store for each part of `pages` pages at `host_indices`."""
        if self.zero_copy:
            return list(self._memory(host_indices, pages))
        return [
            self.pool.get_data_page(offset, flat=True).contiguous()
            for offset in self._offsets(host_indices, pages)
        ]

    def read(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        pool: ThreadPoolExecutor,
        reader: Reader,
    ) -> list[bool]:
        """Read each page's parts into host memory; a page counts only if all its parts
        arrived verified and whole. A flat page is written to the pool only then."""
        hashes = self.hashes(keys)
        if self.zero_copy:
            buffers: list[Any] = list(self._memory(host_indices, len(keys)))
        else:
            offsets = self._offsets(host_indices, len(keys))
            buffers = [self.pool.get_dummy_flat_data_page() for _ in keys]
        got = list(pool.map(lambda h, b: reader(self.client, h, b), hashes, buffers))
        parts = self.parts
        pages = [all(got[i * parts : (i + 1) * parts]) for i in range(len(keys))]
        if not self.zero_copy:
            for offset, page, ok in zip(offsets, buffers, pages, strict=True):
                if ok:
                    self.pool.set_from_flat_data_page(offset, page)
        return pages
