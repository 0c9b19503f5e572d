"""Hybrid models: several KV cache groups (sliding-window, full attention, Mamba state).

vLLM's hybrid KV cache manager gives every group its own block table over the same block
hashes. Each group's blocks are stored under a namespace of their own (so a sliding-window
layer's block never answers for a full-attention one), and a hit is the longest prefix every
group can serve: a full-attention group needs every block before the hit boundary, a
sliding-window group only the blocks inside its window before it (vLLM frees the others and
puts its null block in their place). That is the rule of vLLM 0.33's own OffloadingConnector
(`_lookup_complete_chunks`: a prefix lookup for full attention, a lookup of the window ending
at the boundary for sliding windows, repeated until the boundary stops moving).

A Mamba / linear-attention group (align mode, see `state`) needs only the state at the
boundary: one block, at position `end - 1`, so its lookup moves the boundary back block by
block until a state is found.

A damaged or missing block in any group ends the load for all of them: the hit is only as
long as the shortest group's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvoffload.client_sdk import BlockHash, Client, Namespace, engine_hashes, engine_keys
from kvoffload.connectors.paged_kv import PagedKV
from kvoffload.connectors.vllm.plan import NULL_BLOCK, KVGroup
from kvoffload.connectors.vllm.state import StateKV
from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["GroupKV", "GroupLookup", "chain_hashes", "group_layout", "on_stream", "read_batch",
           "stored_positions"]  # fmt: skip

log = logging.getLogger(__name__)


def group_layout(layout: str, groups: Sequence[KVGroup], index: int) -> str:
    """The namespace layout of group `index`: unchanged for a model with one group (its blocks
    keep the keys they had before hybrid models were supported), else tagged with the group,
    its layer count and its window."""
    if len(groups) == 1:
        return layout
    group = groups[index]
    if group.is_state:
        # A recurrent state's block is not KV: its key names the kind and every state's
        # shape and dtype, so a state of another layout (or of KV) never answers for it.
        shapes = ",".join("x".join(str(d) for d in shape) for shape in group.state_shapes)
        return (f"{layout};hma-group={index}/{len(groups)};layers={len(group.layer_names)}"
                f";state=mamba;shapes={shapes};dtypes={','.join(group.state_dtypes)}")  # fmt: skip
    window = group.sliding_window or 0
    return (f"{layout};hma-group={index}/{len(groups)};layers={len(group.layer_names)}"
            f";window={window}+{group.extra_retained}")  # fmt: skip


class GroupLookup:
    """The scheduler's lookup over every group and tensor-parallel rank.

    Args:
        groups: the KV cache groups, in vLLM's order.
        namespaces: for each rank, the namespace of each group.
        block_tokens: tokens per block.
    """

    def __init__(
        self,
        groups: Sequence[KVGroup],
        namespaces: Sequence[Sequence[Namespace]],
        block_tokens: int,
    ) -> None:
        self._groups = list(groups)
        self._namespaces = [list(per_rank) for per_rank in namespaces]
        self._block_tokens = block_tokens
        self.lookups = 0  # store lookups made (tests count them)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def stored_blocks(self, client: Client, hashes: Sequence[bytes]) -> int:
        """The largest block boundary that every group of every rank can serve."""
        end = len(hashes)
        moved = True
        # Leading blocks a full-attention group of a rank is known to hold: a state group
        # moves the boundary back one block at a time (its states are sparse), and the
        # blocks before a shorter boundary need no second lookup.
        held: dict[tuple[int, int], int] = {}
        # `end` only shrinks, and a pass that moves nothing ends the loop: at most len(hashes)
        # passes, in practice one or two.
        while moved and end > 0:
            moved = False
            for rank, per_rank in enumerate(self._namespaces):
                for g, (group, ns) in enumerate(zip(self._groups, per_rank, strict=True)):
                    first = group.first_needed(end, self._block_tokens)
                    if first >= end or (first == 0 and held.get((rank, g), -1) >= end):
                        continue
                    self.lookups += 1
                    run = client.lookup(engine_keys(ns, hashes[first:end]))
                    if first == 0:
                        held[rank, g] = run
                    if first + run < end:
                        end, moved = first + run, True
        return end


def stored_positions(block_ids: Sequence[int]) -> list[int]:
    """Positions of a group's block table that hold a block (not vLLM's null block)."""
    return [i for i, block in enumerate(block_ids) if block != NULL_BLOCK]


def chain_hashes(
    namespace: Namespace, hashes: Sequence[bytes], parent: bytes | None
) -> tuple[list[BlockHash], BlockHash | None]:
    """Store hashes of a job's blocks in one group, and of the block before them."""
    mapped = engine_hashes(namespace, [*([parent] if parent is not None else []), *hashes])
    if parent is None:
        return mapped, None
    return mapped[1:], mapped[0]


@dataclass
class GroupKV:
    """One group's KV views in a worker, with its own staging buffers."""

    group: KVGroup
    namespace: Namespace
    kv: PagedKV | StateKV
    save_buffer: torch.Tensor
    load_buffer: torch.Tensor
    index: int = 0  # the KV cache group (of a job's block_ids) these views belong to

    @classmethod
    def adopt(
        cls,
        group: KVGroup,
        namespace: Namespace,
        kv_caches: dict[str, Any],
        num_blocks: int,
        batch: int,
        index: int = 0,
    ) -> GroupKV:
        """Wrap vLLM's views of the group's layers and check them against its namespace.

        Raises:
            ConfigError: a layer is missing or the views disagree with the namespace.
        """
        missing = [name for name in group.layer_names if name not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV cache for layers {missing}")
        if group.is_state:
            if namespace.head_size != group.head_width:
                raise ConfigError(f"state namespace holds {namespace.head_size} bytes per "
                                  f"layer, the group {group.head_width}")  # fmt: skip
            state = StateKV([kv_caches[name] for name in group.layer_names], num_blocks,
                            group.head_width, group.layer_names)  # fmt: skip
            return cls(group, namespace, state, state.staging(batch), state.staging(batch),
                       index)  # fmt: skip
        kv = PagedKV([kv_caches[name] for name in group.layer_names], num_blocks)
        item = kv_caches[group.layer_names[0]].element_size()
        seen = (kv.block_tokens, kv.num_kv_heads, kv.width_bytes // item)
        expected = (namespace.block_tokens, namespace.num_kv_heads, namespace.head_size)
        if seen != expected:
            raise ConfigError(
                f"KV views hold (tokens, heads, K+V width) = {seen} per block, the KV cache "
                f"config says {expected}"
            )
        return cls(group, namespace, kv, kv.staging(batch), kv.staging(batch), index)

    def snapshot(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A host copy of blocks `block_ids`, made now: vLLM frees a sliding window's blocks
        as the window moves on, possibly before a background save would read them."""
        out = self.kv.staging(len(block_ids))
        self.kv.gather(torch.tensor(list(block_ids), dtype=torch.long), out)
        if self.kv.device.type == "cuda":
            torch.cuda.current_stream(self.kv.device).synchronize()
        return out


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the block on `stream` (a CPU's None: as is) and wait for it: the staging rows it
    copied from or into are used again right after."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def read_batch(
    client: Client, keys: Sequence[BlockHash], buffer: torch.Tensor, block_bytes: int
) -> int:
    """Verified blocks straight into the staging rows, in one pipelined batch; returns how
    many leading blocks can be used. Rows past that count hold unverified bytes: never
    scatter them."""
    try:
        got = client.get_many_into(keys, [buffer[i] for i in range(len(keys))])
    except KVOffloadError as exc:
        log.warning("kvoffload: reading %d blocks failed: %s", len(keys), exc)
        return 0
    ok = 0
    while ok < len(got) and got[ok] == block_bytes:
        ok += 1
    if ok < len(got):
        key, size = keys[ok], got[ok]
        if size is not None:
            log.warning("kvoffload: block %s holds %d bytes, expected %d", key[:16].hex(),
                        size, block_bytes)  # fmt: skip
        # Missing or damaged: drop whatever is stored under the key, so that the recomputed
        # block is saved again instead of failing every later load.
        with contextlib.suppress(KVOffloadError):
            client.delete(key)
    return ok
