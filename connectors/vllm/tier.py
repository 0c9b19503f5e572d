"""`KVOffloadTier`: the store as a secondary tier behind vLLM's own pinned-CPU offload tier.

vLLM 0.33.0's ``TieringOffloadingSpec`` keeps offloaded chunks in a CPU primary tier and
cascades them to secondary tiers; a tier runs in the scheduler process and copies chunks
between the primary tier's shared memory and its storage. This tier puts a chunk straight from
that memory and reads one straight into it (verified first), so vLLM keeps its GPU copy
kernels and its CPU cache policy, and the store adds capacity, an SSD tier and sharing across
engines::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",
      "cpu_bytes_to_use":10737418240,"secondary_tiers":[{"type":"KVOffloadTier",
      "module_path":"kvoffload.connectors.vllm","url":"kv://127.0.0.1:7480"}]}}'

Hybrid models (several KV cache groups: full and sliding-window attention, Mamba /
linear-attention state in align mode): vLLM's offloading connector keys each group's chunk by
block hash and group index and decides itself which chunks a hit needs (a prefix of a full
group, the window of a sliding group, one state chunk at the boundary of a Mamba group). The
tier stores every chunk as a part of its own, under a namespace naming its group, answers each
lookup for that part alone, and verifies each part when it reads it; vLLM claims a hit only
where every group's parts answered. What vLLM tells a tier of a group is its
`OffloadingGroupConfig` (index, block size, layer names, and in 0.33 the window in chunks):
not its kind, so a Mamba group and a sliding-window group look alike (both bounded windows).
A state's layout (shapes, dtypes, cache mode) the tier reads from the KV cache config of the
vLLM frame that builds it (`_compat.offloading_engine_configs`), into the state group's
namespace (see `TierGroup`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import blake3

from kvoffload.client_sdk import BlockHash, Client, Namespace, engine_hashes
from kvoffload.client_sdk.keys import DTYPE_BYTES
from kvoffload.connectors.store_url import block_store_url
from kvoffload.connectors.vllm import _compat
from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["KVOffloadTier", "TierGroup"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierGroup:
    """One KV cache group as vLLM hands it to a tier (`OffloadingGroupConfig`).

    `window` is vLLM 0.33's ``sliding_window_size_in_chunks``: None for full attention, the
    chunks a request keeps for a sliding-window or chunked-local group, and 1 for a Mamba /
    linear-attention state group. vLLM 0.32 has no such field (`known` False): every group's
    kind is then unknown. `state` is how the group's recurrent state is laid out
    (`_compat.state_layout`: Mamba cache mode, state shapes and dtypes, page and block size),
    read from vLLM's KV cache config when the tier could see it, else "" (as for attention).
    """

    group_id: int
    tokens_per_block: int
    layer_names: tuple[str, ...]
    window: int | None
    known: bool = True
    state: str = ""

    @property
    def kind(self) -> str:
        if not self.known:
            return "unknown"
        return "full" if self.window is None else f"window={self.window}"

    @property
    def may_hold_state(self) -> bool:
        """True unless vLLM said the group is full attention: a bounded window may be a
        recurrent state's group (vLLM gives a tier no way to tell)."""
        return self.kind != "full"

    def describe(self) -> str:
        names = ", ".join(self.layer_names[:3])
        more = f", ... ({len(self.layer_names)} layers)" if len(self.layer_names) > 3 else ""
        return f"KV cache group {self.group_id} ({self.kind}; layers {names}{more})"


def tier_groups(spec: Any, kv_cache_config: Any = None) -> tuple[TierGroup, ...]:
    """The groups of vLLM's offload config, in its order; with the engine's `KVCacheConfig`,
    each state group's state layout too."""
    return tuple(
        TierGroup(
            group_id=int(g.group_id),
            tokens_per_block=int(g.tokens_per_block),
            layer_names=tuple(g.layer_names),
            window=getattr(g, "sliding_window_size_in_chunks", None),
            known=hasattr(g, "sliding_window_size_in_chunks"),
            state=(
                _compat.state_layout(kv_cache_config, int(g.group_id))
                if kv_cache_config is not None
                else ""
            ),
        )
        for g in spec.config.groups
    )


def tier_namespace(
    spec: Any, chunk_bytes: int, hash_algo: str, salt: str, codec: str = ""
) -> Namespace:
    """Everything that makes two engines' chunks incompatible, from vLLM's offload config."""
    config = spec.config
    parallel = config.parallel
    dtype = config.model.dtype if config.model.dtype in DTYPE_BYTES else "uint8"
    groups = config.groups
    layout = (
        f"vllm-tier:{config.kv_cache_layout}:canonical={int(config.canonical_layout)}"
        f":replicated={int(config.replicated_layout)}:dtype={config.model.dtype}"
        f":chunk={chunk_bytes}:world={parallel.world_size}:pp={parallel.pp_size}"
        f":pcp={parallel.pcp_size}:dcp={parallel.dcp_size}"
        f":groups={[(g.group_id, g.tokens_per_block) for g in groups]}"
    )
    return Namespace(
        model=config.model.name,
        dtype=dtype,
        block_tokens=groups[0].tokens_per_block * config.cache.blocks_per_chunk,
        num_layers=sum(len(g.layer_names) for g in groups),
        layout=layout,
        tp_size=parallel.tp_size,
        hash_algo=f"vllm:{hash_algo}",
        salt=salt,
        codec=codec,
    )


def group_namespace(
    base: Namespace, group: TierGroup, groups: int, blocks_per_chunk: int
) -> Namespace:
    """The namespace of one group's parts: `base` itself for a model of one full-attention
    group (its chunks keep the keys they had before hybrid models), else tagged with the
    group's index, kind and layers, so no group's part answers for another's, and a state
    group's with its state layout, so engines whose states differ (another Mamba state dtype,
    same chunk size) share no keys."""
    if groups == 1 and group.kind in ("full", "unknown") and not group.state:
        return base
    names = blake3.blake3("\0".join(group.layer_names).encode()).hexdigest()[:16]
    layout = (f"{base.layout};tier-group={group.group_id}/{groups};kind={group.kind}"
              f";layers={len(group.layer_names)}:{names}")  # fmt: skip
    if group.state:
        layout += f";state={group.state}"
    return Namespace(
        model=base.model,
        # A state part's bytes are not of the KV dtype (vLLM pads state pages as raw bytes).
        dtype="uint8" if group.may_hold_state else base.dtype,
        block_tokens=group.tokens_per_block * blocks_per_chunk,
        num_layers=len(group.layer_names),
        layout=layout,
        tp_size=base.tp_size,
        hash_algo=base.hash_algo,
        salt=base.salt,
        codec=base.codec,
    )


def check_tier_codec(namespace: Namespace, groups: Sequence[TierGroup]) -> None:
    """Refuse a lossy codec: for a group that may hold Mamba / linear-attention state because a
    recurrent state's error is carried into every later token's state, and for any other
    because the KV codecs quantise per head and vLLM gives a tier no KV shape.

    Raises:
        ConfigError: the codec is lossy (naming a group that may hold state, if one does).
        UnsupportedCodecConfigError: the namespace names an unknown codec.
    """
    codec = namespace.lossy_codec
    if not codec:
        return
    for group in groups:
        if group.may_hold_state:
            raise ConfigError(
                f"KVOffloadTier: codec {codec!r} is lossy and {group.describe()} may hold "
                "Mamba / linear-attention state, which must be stored losslessly (its errors "
                "compound over every later token); vLLM 0.33 tells a secondary tier only a "
                "group's window, not its kind, so every group with a bounded window (and, "
                "under vLLM 0.32, every group) is treated as state: use a lossless codec "
                "(none, zstd, ...) for this model"
            )
    raise ConfigError(
        f"KVOffloadTier: codec {codec!r} is lossy, and a lossy KV codec needs the KV's shape "
        "(heads, head size), which vLLM's offload config does not give a secondary tier: use "
        "a lossless codec (none, zstd, ...)"
    )


class _Lookups(_compat.AsyncLookupManager):
    """vLLM's non-blocking lookup cache, answered with store lookups per group."""

    def __init__(self, tier: KVOffloadTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[bytes], req_context: Any) -> Iterable[bool]:
        # One step's keys of a request, of every group, in the order vLLM asked for them.
        tier = self._tier
        found = [False] * len(keys)
        by_group: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_group.setdefault(tier.group_of(key).group_id, []).append(i)
        for group_id, positions in by_group.items():
            hashes = tier.hashes([keys[i] for i in positions])
            alone = positions
            if tier.chained(group_id):
                # A full group's chunks are asked in chain order and stop at the first miss,
                # so a prefix count answers them; a chunk after a gap reads as a miss (never a
                # false hit), and vLLM could not use it anyway. Its partial tails (keyed at a
                # hash boundary inside a block, asked largest first) are no chain: each
                # answers for itself below, so a smaller stored boundary still hits.
                tails = {n for n, i in enumerate(positions)
                         if tier.partial_tail(keys[i], req_context)}  # fmt: skip
                chain = [n for n in range(len(positions)) if n not in tails]
                hit = tier.client.lookup([hashes[n] for n in chain]) if chain else 0
                for rank, n in enumerate(chain):
                    found[positions[n]] = rank < hit
                alone = [positions[n] for n in sorted(tails)]
                hashes = [hashes[n] for n in sorted(tails)]
            # A windowed or state group is asked from the end backwards and its parts are
            # sparse (a state only where vLLM cached one): each part answers for itself, so a
            # missing part ends the hit there, not at every part behind it. One batched call
            # (over kv:// a pipelined run of Exists requests), not a round trip per part.
            if alone:
                for i, one in zip(alone, tier.client.exists_many(hashes), strict=True):
                    found[i] = one
        return found


class KVOffloadTier(_compat.SecondaryTierManager):
    """A `SecondaryTierManager` backed by a kvoffload store.

    Args (tier config keys besides ``type`` and ``module_path``):
        url: the store, e.g. ``kv://127.0.0.1:7480``.
        salt: deployment salt mixed into every key.
        hash_algo: vLLM's prefix-caching hash, used only when the tier cannot read vLLM's
            config.
        io_threads: transfer jobs that run at once.
        codec: the codec parts are written with ("" or ``none``: raw; or a lossless codec such
            as ``zstd``). Lossy codecs are refused (`check_tier_codec`).

    Raises:
        ConfigError: a lossy codec (`check_tier_codec`).
        UnsupportedCodecConfigError: an unknown codec.
    """

    medium: ClassVar[Any] = _compat.Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str,
        salt: str = "",
        hash_algo: str = "sha256",
        io_threads: int = 4,
        codec: str = "",
        backpressure_detector: Any = None,
        locality: str | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        algo = _compat.tier_hash_algo(hash_algo)
        engine = _compat.offloading_engine_configs()
        self.groups = tier_groups(offloading_spec, engine[1] if engine is not None else None)
        if engine is None and any(g.may_hold_state for g in self.groups):
            log.warning(
                "KVOffloadTier: built outside vLLM's offloading connector scheduler, the tier "
                "cannot see vLLM's KV cache config: its state groups' keys do not name their "
                "state dtypes, so engines that differ only in those must use different salts"
            )
        self.namespace = tier_namespace(offloading_spec, self.block_size_bytes, algo, salt, codec)
        check_tier_codec(self.namespace, self.groups)
        chunk_blocks = int(offloading_spec.config.cache.blocks_per_chunk)
        self._chunk_tokens = {g.group_id: g.tokens_per_block * chunk_blocks for g in self.groups}
        self.namespaces = {
            g.group_id: group_namespace(self.namespace, g, len(self.groups), chunk_blocks)
            for g in self.groups
        }
        self._by_id = {g.group_id: g for g in self.groups}
        self.client = Client.connect(block_store_url(url), namespace=self.namespace)
        self._chunks = primary_kv_view.cast("B")
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-tier")
        self._lock = threading.Lock()
        self._finished: list[Any] = []
        self._missing: list[bytes] = []  # keys of failed loads, for the lookup cache
        self._running = 0
        self._idle = threading.Condition(self._lock)
        self._lookups = _Lookups(self, tier_type)

    def group_of(self, key: bytes) -> TierGroup:
        """The group an offload key names.

        Raises:
            KVOffloadError: vLLM's offload config does not list that group.
        """
        group_id = _compat.get_offload_group_idx(bytes(key))
        group = self._by_id.get(group_id)
        if group is None:
            raise KVOffloadError(
                f"KVOffloadTier: vLLM handed the tier a chunk of KV cache group {group_id}, "
                f"which its offload config does not list (groups {sorted(self._by_id)})"
            )
        return group

    def chained(self, group_id: int) -> bool:
        """Whether a group's parts form a chain (full attention: every chunk of a prefix)
        rather than sparse parts (a window, or a state at some boundaries). A model of one
        group under vLLM 0.32, which names no kinds, is taken as full attention, as before."""
        group = self._by_id[group_id]
        return not group.may_hold_state or (len(self.groups) == 1 and group.kind == "unknown")

    def partial_tail(self, key: bytes, req_context: Any) -> bool:
        """Whether vLLM made `key` a partial tail: a boundary inside a block (its recorded
        token position is not a whole number of the group's chunks), not a chunk of a chain."""
        position = _compat.key_position(req_context, bytes(key))
        chunk = self._chunk_tokens[self.group_of(key).group_id]
        return position is not None and position % chunk != 0

    def hashes(self, keys: Sequence[bytes]) -> list[BlockHash]:
        """Store hashes of vLLM offload keys (block hash + group index), each under its
        group's namespace.

        Raises:
            KVOffloadError: a key names a group the offload config does not list.
        """
        out: list[BlockHash] = []
        for key in keys:
            raw = bytes(key)
            out += engine_hashes(self.namespaces[self.group_of(raw).group_id], [raw])
        return out

    def _chunk(self, chunk_id: int) -> memoryview:
        size = self.block_size_bytes
        return self._chunks[chunk_id * size : (chunk_id + 1) * size]

    # -- vLLM's tier interface ------------------------------------------------------------

    def on_new_request(self, req_context: Any) -> Any:
        return _compat.RequestOffloadingContext()

    def lookup(self, key: Any, req_context: Any) -> Any:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return _compat.LookupResult.RETRY
        return _compat.LookupResult.HIT if found else _compat.LookupResult.MISS

    def submit_store(self, job_metadata: Any) -> None:
        self._submit(self._store, job_metadata)

    def submit_load(self, job_metadata: Any) -> None:
        self._submit(self._load, job_metadata)

    def get_finished_jobs(self) -> Iterable[Any]:
        with self._lock:
            done, self._finished = self._finished, []
            missing, self._missing = self._missing, []
        # Chunks that failed to load read as misses from now on, so vLLM does not retry a
        # doomed promotion (the lookup cache belongs to this, the scheduler's, thread).
        self._lookups.mark_miss(missing)
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._running > 0 or bool(self._finished)

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0)

    def on_request_finished(self, req_context: Any) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        self._lookups.flush()

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self.client.close()
        self._chunks.release()  # vLLM unmaps the primary tier's memory after this

    # -- transfers (pool threads) ---------------------------------------------------------

    def _submit(self, work: Any, job: Any) -> None:
        with self._lock:
            self._running += 1
        self._pool.submit(self._run, work, job)

    def _run(self, work: Any, job: Any) -> None:
        started = time.monotonic()
        try:
            result = work(job, started)
        except Exception as exc:
            # A thread boundary: the job fails, vLLM keeps or recomputes its chunks.
            log.warning("kvoffload tier: job %s failed: %s", job.job_id, exc)
            result = _compat.JobResult(job_id=job.job_id, success=False)
        with self._idle:
            self._finished.append(result)
            self._running -= 1
            self._idle.notify_all()

    def _store(self, job: Any, started: float) -> Any:
        keys = [bytes(k) for k in job.keys]
        hashes = self.hashes(keys)
        chunks = [self._chunk(int(c)) for c in job.chunk_ids]
        # A chunk's parent is the one before it in its own group's chain; sparse groups'
        # parts (windows, states) and partial tails have none.
        parents: list[bytes | None] = []
        last: dict[int, bytes] = {}
        for key, one in zip(keys, hashes, strict=True):
            group_id = self.group_of(key).group_id
            if not self.chained(group_id) or self.partial_tail(key, job.req_context):
                parents.append(None)  # a window's, a state's or a partial tail's part
                continue
            parents.append(last.get(group_id))
            last[group_id] = one
        self.client.put_many(zip(hashes, chunks, strict=True), parents=parents)
        return _compat.JobResult(
            job_id=job.job_id,
            success=True,
            transfer_time=time.monotonic() - started,
            transfer_bytes=len(keys) * self.block_size_bytes,
        )

    def _load(self, job: Any, started: float) -> Any:
        keys = list(job.keys)
        loaded = 0
        # Each part is read and verified on its own, whatever its group.
        for key, chunk_id in zip(self.hashes(keys), job.chunk_ids, strict=True):
            try:
                got = self.client.get_into(key, self._chunk(int(chunk_id)))
            except KVOffloadError as exc:
                log.warning("kvoffload tier: reading a chunk failed: %s", exc)
                got = None
            if got != self.block_size_bytes:
                break
            loaded += 1
        if loaded < len(keys):
            # vLLM keeps the chunks before the failure and recomputes the rest.
            with self._lock:
                self._missing.extend(keys[loaded:])
        return _compat.JobResult(
            job_id=job.job_id,
            success=loaded == len(keys),
            successful_keys=tuple(keys[:loaded]) if 0 < loaded < len(keys) else None,
            transfer_time=time.monotonic() - started,
            transfer_bytes=loaded * self.block_size_bytes,
        )
