"""`KVOffloadConnector`: vLLM's v1 KV connector interface over a kvoffload store.

Shaped like vLLM's own OffloadingConnector: one class that vLLM builds twice, once in the
scheduler process (role SCHEDULER) and once in each worker (role WORKER); each instance
builds the matching half and delegates its hooks to it. The halves talk only through vLLM:
the scheduler's per-step plan (`KVOffloadConnectorMetadata`) goes to the workers, the workers'
finished transfers and failed blocks come back in vLLM's connector output.
"""

from __future__ import annotations

from typing import Any

import torch

from kvoffload.client_sdk import Client, Namespace
from kvoffload.connectors.paged_kv import CANONICAL_LAYOUT
from kvoffload.connectors.store_url import block_store_url
from kvoffload.connectors.vllm import _compat
from kvoffload.connectors.vllm.claim import KVOffloadStats
from kvoffload.connectors.vllm.groups import GroupLookup, group_layout
from kvoffload.connectors.vllm.layers import part_groups, part_layout, split_layers
from kvoffload.connectors.vllm.plan import Settings, StepPlan, namespace_for
from kvoffload.connectors.vllm.scheduler import SchedulerHalf
from kvoffload.connectors.vllm.state import check_state_codec
from kvoffload.connectors.vllm.worker import WorkerHalf
from kvoffload.errors import ConfigError

__all__ = ["KVOffloadConnector", "KVOffloadConnectorMetadata"]


class KVOffloadConnectorMetadata(_compat.KVConnectorMetadata):
    """One step's `StepPlan`, in the type vLLM expects."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVOffloadConnector(_compat.KVConnectorBase_V1, _compat.SupportsHMA):
    """Prefix KV cache in a kvoffload store, for vLLM 0.33.0 (and 0.32.0), including hybrid
    models (several KV cache groups: full and sliding-window attention, see `groups`; Mamba /
    linear-attention state with Mamba prefix caching in align mode, see `state`).

    Load it with ``--kv-transfer-config '{"kv_connector":"KVOffloadConnector",
    "kv_connector_module_path":"kvoffload.connectors.vllm","kv_role":"kv_both",
    "kv_connector_extra_config":{"url":"kv://host:7480"}}'``; the extra config keys are the
    fields of `Settings`.

    Raises:
        ConfigError: bad extra config, or a model layout the connector does not handle.
    """

    # Hits come from a store behind the host (DRAM and SSD tiers, local or remote).
    _cache_hit_source = _compat.CacheHitSource.DISK

    namespace: Namespace
    """The namespace of this process's blocks (the scheduler's: tensor-parallel rank 0; with
    layer parts, that of part 0)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._settings = Settings.from_extra_config(extra)
        geometry = _compat.geometry(vllm_config, kv_cache_config)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None

        groups = geometry.groups
        parts = self._settings.layer_parts
        if parts > 1 and (len(groups) > 1 or groups[0].sliding_window is not None):
            raise ConfigError(
                "layer_parts > 1 is not supported yet for hybrid models (several "
                "KV cache groups or a sliding window); use layer_parts=1"
            )
        # With layer parts, the model's one group cut into parts of contiguous layers.
        spans = split_layers(len(groups[0].layer_names), parts)
        pieces = part_groups(groups[0], parts) if parts > 1 else groups

        def namespace(rank: int, g: int = 0, part: int = 0) -> Namespace:
            group = pieces[part] if parts > 1 else groups[g]
            layout = group_layout(CANONICAL_LAYOUT, groups, g)
            return namespace_for(
                model=geometry.model,
                revision=geometry.revision,
                dtype=group.dtype,
                block_tokens=geometry.block_tokens,
                num_layers=len(group.layer_names),
                num_kv_heads=group.num_kv_heads,
                head_width=group.head_width,
                layout=part_layout(layout, part, parts, spans[part]),
                tp_rank=rank,
                tp_size=geometry.tp_size,
                hash_algo=geometry.hash_algo,
                salt=self._settings.salt,
            )

        self.namespace = namespace(0)
        if role == _compat.KVConnectorRole.SCHEDULER:
            # The connector owns what a failed load means: a block evicted between lookup
            # and load is normal for a cache, so by default vLLM recomputes it.
            _compat.set_load_failure_policy(vllm_config, self._settings.load_failure_policy)
            namespaces = [[namespace(rank, part=p) for p in range(parts)]
                          for rank in range(geometry.tp_size)]  # fmt: skip
            client = Client.connect(block_store_url(self._settings.url), namespace=namespaces[0][0])
            lookup = None
            if len(groups) > 1 or groups[0].sliding_window is not None:
                per_rank = [[namespace(rank, g) for g in range(len(groups))]
                            for rank in range(geometry.tp_size)]  # fmt: skip
                lookup = GroupLookup(groups, per_rank, geometry.block_tokens)
            self._scheduler = SchedulerHalf(
                self._settings, client, namespaces, geometry.block_tokens, geometry.hash_ratio,
                groups=lookup, on_cpu=_compat.device_type(vllm_config) == "cpu",
                async_scheduling=_compat.async_scheduling(vllm_config),
                state_groups=[g for g, group in enumerate(groups) if group.is_state],
            )  # fmt: skip
        else:
            rank = _compat.tensor_parallel_rank()
            self.namespace = namespace(rank)
            client = Client.connect(block_store_url(self._settings.url), namespace=self.namespace)
            for g, group in enumerate(groups):
                if group.is_state:
                    check_state_codec(client, f"KV cache group {g} ({group.layer_names[0]}, ...)")
            if parts > 1:
                mine = [namespace(rank, part=p) for p in range(parts)]
            else:
                mine = [namespace(rank, g) for g in range(len(groups))]
            self._worker = WorkerHalf(self._settings, client, mine, pieces,
                                      kv_cache_config.num_blocks, layered=parts > 1)  # fmt: skip

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a save that never happens is a later miss, not lost work.
        return False

    # -- scheduler side -------------------------------------------------------------------

    def _sched(self) -> SchedulerHalf:
        assert self._scheduler is not None, "called a scheduler hook on a worker connector"
        return self._scheduler

    def _work(self) -> WorkerHalf:
        assert self._worker is not None, "called a worker hook on the scheduler connector"
        return self._worker

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past `num_computed_tokens` whose KV the store holds (one lookup per
        tensor-parallel rank; the last prompt token is never counted), and whether they load
        asynchronously (`Settings.sync_load_blocks`)."""
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the external tokens into the blocks vLLM just allocated."""
        self._sched().update_state_after_alloc(
            request, _compat.block_ids_of(blocks), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVOffloadConnectorMetadata:
        """This step's loads, the saves of blocks this step completes, preempted requests."""
        return KVOffloadConnectorMetadata(self._sched().build_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        scheduler = self._sched()
        if connector_output.invalid_block_ids:
            scheduler.loads_failed(connector_output.invalid_block_ids)
        if getattr(connector_output, "failed_recving", None):
            scheduler.requests_failed(connector_output.failed_recving)
        scheduler.loads_finished(connector_output.finished_recving or ())
        stats = getattr(connector_output, "kv_connector_stats", None)
        if isinstance(stats, KVOffloadStats):
            scheduler.claim.observe(stats.data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVOffloadStats:
        """vLLM's logger rebuilds the workers' stats from their data with this."""
        stats = KVOffloadStats()
        if data:
            stats.data = dict(data)
        else:
            stats.reset()
        return stats

    def get_kv_connector_stats(self) -> KVOffloadStats | None:
        """The workers' load and prefill rates since the last step (None on the scheduler)."""
        return self._worker.take_rates() if self._worker is not None else None

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep a request's blocks until every worker has saved them."""
        return self._sched().request_finished(request), None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` of hybrid models (vLLM's `SupportsHMA`): the same rule, since
        the saves of every group run as one job per request."""
        return self._sched().request_finished(request), None

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register(kv_caches)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVOffloadConnectorMetadata)
        return meta.plan

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """vLLM binds each step's plan before its forward (and calls `start_load_kv` after
        the forward when no load is synchronous): the step's compute time starts here."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_step()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Finish reading blocks before vLLM hands preempted requests' blocks to others."""
        if isinstance(kv_connector_metadata, KVOffloadConnectorMetadata) and (
            kv_connector_metadata.plan.preempted
        ):
            self._work().wait_for_saves()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Run this step's synchronous loads (vLLM calls this before the forward that reads
        them) and start the others in the background (their requests wait in vLLM's
        WAITING_FOR_REMOTE_KVS state, so no forward depends on them)."""
        self._work().start_loads(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With layer parts: block until the part holding `layer_name` of this step's loads
        is in the KV cache (bounded by `layer_load_timeout_s`); else at once (loads complete
        before the forward that reads them)."""
        self._work().wait_for_layer(layer_name)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise waits run Python between layers, which a full CUDA graph would skip."""
        parts = (extra_config or {}).get("layer_parts", 1)
        return isinstance(parts, int) and parts > 1

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are saved once the step's forward is done

    def wait_for_save(self) -> None:
        """Queue the saves of the blocks this step completed (they run in the background;
        their blocks stay allocated until `get_finished` reports them)."""
        self._work().submit_saves(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, received = self._work().get_finished(finished_req_ids)
        return sent or None, received or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """`get_finished`, plus (hybrid models) the requests whose load failed: vLLM cannot
        take failed block ids from a model with several KV cache groups."""
        sent, received = self._work().get_finished(finished_req_ids)
        return _compat.KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received,
            failed_recving=self._work().take_failed(),
        )  # fmt: skip

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed (missing, corrupt, store unreachable): vLLM recomputes
        them instead of using what is in them."""
        return self._work().take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_saves()
            self._worker.shutdown()
