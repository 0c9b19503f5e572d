"""Settings and the per-step plan the scheduler half sends to the worker halves.

Nothing here imports vLLM: the plan travels inside vLLM's connector metadata (pickled to the
worker processes), and the settings come from ``kv_connector_extra_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvoffload.client_sdk import BlockMeta, Namespace, TierRun
from kvoffload.errors import ConfigError, InvalidArgumentError

__all__ = ["FULL", "NULL_BLOCK", "SLIDING", "STATE", "KVGroup", "LoadJob", "SaveJob", "Settings",
           "StepPlan", "block_metas", "event_hash", "namespace_for"]  # fmt: skip

# vLLM's null block: what a block table holds where a sliding-window group dropped (or never
# allocated) a block outside its window. Such positions are neither loaded nor saved.
NULL_BLOCK = 0


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` of `KVOffloadConnector`; one comment per key."""

    # The store: kv://host:port[?token=...] (a local:// store is private to one process, so it
    # only works when the scheduler and the workers share it, as in tests).
    url: str = ""
    # Deployment salt mixed into every key: stores shared by deployments that must never see
    # each other's blocks use different salts (vLLM's per-request cache_salt is already part
    # of its block hashes).
    salt: str = ""
    # Blocks moved per staging batch (one staging buffer of this many blocks for saves and
    # one for loads, per worker).
    batch_blocks: int = 16
    # Unused since a load reads each staging batch in one pipelined request (kept so that
    # existing configs still load).
    load_threads: int = 4
    # Save only prompt blocks (vLLM's OffloadingConnector default); by default blocks filled by
    # decoding are saved too, so the next turn of a conversation finds its previous answer.
    offload_prompt_only: bool = False
    # What vLLM does with blocks whose load failed: "recompute" them, or "fail" the request.
    load_failure_policy: str = "recompute"
    # Which hits to claim: "cost" only those whose load beats recomputing them (from the rates
    # below), "all" every hit (see connectors/vllm/claim.py).
    claim: str = "cost"
    # Blocks per second one worker loads; 0 = measured by the workers as they load.
    load_blocks_per_s: float = 0.0
    # Tokens per second one worker's forward pass computes in prefill; 0 = measured (CPU
    # workers only: on a GPU the forward returns before its kernels finish, so tell it there).
    prefill_tokens_per_s: float = 0.0
    # Loads of at most this many blocks run synchronously, before the forward of the step that
    # schedules their request; larger ones run in the background while the request waits a
    # scheduler step (vLLM's WAITING_FOR_REMOTE_KVS). -1: every load on a CPU (nothing else
    # computes while it runs, and the wait costs a step), none on a GPU.
    sync_load_blocks: int = -1
    # Each block is stored as this many values, each holding a contiguous run of the model's
    # layers (sizes differ by at most one), sealed and verified on its own. With more than one,
    # a hit loads part by part while the step's forward runs: attention layer l waits only
    # for the part holding it (connectors/vllm/layers.py). 1: whole blocks, as before.
    layer_parts: int = 1
    # With layer parts: the longest a step's forward waits for its loads; on timeout the
    # blocks not yet loaded are reported failed (vLLM recomputes them). The wait holds the
    # whole batch (other requests' decodes too), so it is short: a step's loads take
    # milliseconds to a few hundred of them from a healthy store.
    layer_load_timeout_s: float = 5.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> Settings:
        """Parse and check the connector's extra config.

        Raises:
            ConfigError: an unknown key, a missing url or a bad value.
        """
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; valid: {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            expected = type(getattr(cls, name))
            if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)  # JSON writes 2000.0 as 2000
            if expected is not int and not isinstance(value, expected):
                raise ConfigError(f"{name} must be a {expected.__name__}, got {value!r}")
            values[name] = value
        settings = cls(**values)
        if not settings.url:
            raise ConfigError('kv_connector_extra_config needs "url" (e.g. "kv://host:7480")')
        if settings.batch_blocks <= 0 or settings.load_threads <= 0:
            raise ConfigError("batch_blocks and load_threads must be positive")
        if settings.load_failure_policy not in ("recompute", "fail"):
            raise ConfigError('load_failure_policy must be "recompute" or "fail"')
        if settings.claim not in ("cost", "all"):
            raise ConfigError('claim must be "cost" or "all"')
        if settings.load_blocks_per_s < 0 or settings.prefill_tokens_per_s < 0:
            raise ConfigError("load_blocks_per_s and prefill_tokens_per_s must not be negative")
        if settings.sync_load_blocks < -1:
            raise ConfigError("sync_load_blocks must be -1 (automatic), 0 (never) or positive")
        if settings.layer_parts < 1:
            raise ConfigError(f"layer_parts must be at least 1, got {settings.layer_parts}")
        if not settings.layer_load_timeout_s > 0:
            raise ConfigError("layer_load_timeout_s must be positive")
        return settings


def namespace_for(
    *,
    model: str,
    revision: str,
    dtype: str,
    block_tokens: int,
    num_layers: int,
    num_kv_heads: int,
    head_width: int,
    layout: str,
    tp_rank: int,
    tp_size: int,
    hash_algo: str,
    salt: str,
) -> Namespace:
    """The namespace of one tensor-parallel rank's blocks (K and V share `head_width`)."""
    return Namespace(
        model=model,
        revision=revision,
        dtype=dtype,
        block_tokens=block_tokens,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_width,
        layout=layout,
        tp_rank=tp_rank,
        tp_size=tp_size,
        hash_algo=f"vllm:{hash_algo}",
        salt=salt,
    )


# Kinds of KV cache group (`KVGroup.kind`).
FULL = "full"  # full attention (MLA included): every block before a hit boundary
SLIDING = "sliding"  # sliding-window attention: the blocks inside the window
STATE = "state"  # Mamba / linear-attention recurrent state: one block per boundary


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group (hybrid models have several: e.g. sliding-window and full-attention
    layers, or Mamba state beside attention), as both halves need it."""

    layer_names: tuple[str, ...]
    num_kv_heads: int  # per rank (state groups: 1)
    head_width: int  # K and V concatenated (state groups: state bytes of one layer)
    dtype: str  # KV dtype (state groups: the first state's dtype)
    sliding_window: int | None = None  # tokens; None: full attention
    extra_retained: int = 0  # vLLM's SlidingWindowSpec.extra_retained_tokens
    kind: str = FULL
    # State groups: each layer's states (e.g. conv and SSM state), as vLLM's MambaSpec names
    # them; a block holds every layer's states after the block's last token.
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()

    @property
    def is_state(self) -> bool:
        return self.kind == STATE

    def first_needed(self, end: int, block_tokens: int) -> int:
        """The first block this group keeps once `end` blocks are computed: vLLM's
        `get_num_skipped_tokens` in blocks (0 for full attention; a state group needs only
        the state at the boundary, held by block `end - 1`)."""
        if self.kind == STATE:
            return max(0, end - 1)
        if self.sliding_window is None:
            return 0
        skipped = end * block_tokens - self.sliding_window + 1 - self.extra_retained
        return max(0, skipped) // block_tokens


@dataclass(frozen=True)
class LoadJob:
    """Read `hashes` (vLLM block hashes, in chain order) into GPU blocks `block_ids` (one tuple
    per KV cache group, each as long as `hashes`; `NULL_BLOCK` where a group needs no block)."""

    req_id: str
    block_ids: tuple[tuple[int, ...], ...]
    hashes: tuple[bytes, ...]
    # Where the blocks were at the scheduler's lookup (rank 0's), so that each staging batch
    # holds one tier and its time measures that tier's load rate.
    tiers: TierRun = TierRun()
    # Loaded before this step's forward (which reads the blocks), not in the background.
    sync: bool = False


@dataclass(frozen=True)
class SaveJob:
    """Write GPU blocks `block_ids` (per group, as in `LoadJob`) under `hashes`; `parent` is
    the hash of the block before."""

    req_id: str
    block_ids: tuple[tuple[int, ...], ...]
    hashes: tuple[bytes, ...]
    parent: bytes | None
    # The token ids of each block (one tuple per hash; empty when vLLM did not say) and the
    # request's LoRA: sent with the puts so that the store's KV events carry them.
    tokens: tuple[tuple[int, ...], ...] = ()
    lora_name: str | None = None


def event_hash(block_hash: bytes) -> int:
    """A vLLM block hash as vLLM's KV events publish it with integer hashes (the low 64 bits,
    big-endian: `maybe_convert_block_hash`), so the store's events name a block as vLLM's do."""
    return int.from_bytes(block_hash[-8:], "big")


def block_metas(job: SaveJob, start: int, stop: int) -> list[BlockMeta | None] | None:
    """The `BlockMeta` of blocks `start:stop` of a save, or None without token ids (or with
    ones out of `BlockMeta`'s bounds: the blocks are saved without metadata, not dropped)."""
    if len(job.tokens) != len(job.hashes):
        return None
    out: list[BlockMeta | None] = []
    try:
        for i in range(start, stop):
            parent = job.hashes[i - 1] if i else job.parent
            out.append(BlockMeta(job.tokens[i], block_hash=event_hash(job.hashes[i]),
                                 parent_hash=None if parent is None else event_hash(parent),
                                 lora_name=job.lora_name))  # fmt: skip
    except InvalidArgumentError:
        return None
    return out


@dataclass(frozen=True)
class StepPlan:
    """One scheduler step's work for the workers."""

    loads: tuple[LoadJob, ...] = ()
    saves: tuple[SaveJob, ...] = ()
    preempted: frozenset[str] = field(default_factory=frozenset)
    scheduled_tokens: int = 0  # tokens this step's forward computes (for the prefill rate)
