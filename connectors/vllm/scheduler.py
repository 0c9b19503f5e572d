"""The scheduler half of `KVOffloadConnector`: decides what to load and what to save.

It runs in vLLM's engine-core process and never touches KV bytes. A request's blocks are named
by vLLM's own chained block hashes (which already cover LoRA, multimodal inputs and the
request's cache salt) mixed with the namespace of each tensor-parallel rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.client_sdk import Client, Namespace, Tier, TierRun, engine_keys
from kvoffload.connectors.vllm import _compat
from kvoffload.connectors.vllm.claim import ClaimRule
from kvoffload.connectors.vllm.groups import GroupLookup
from kvoffload.connectors.vllm.plan import NULL_BLOCK, LoadJob, SaveJob, Settings, StepPlan
from kvoffload.errors import ConfigError

__all__ = ["SchedulerHalf"]

log = logging.getLogger(__name__)


@dataclass
class _Request:
    request: Any  # vllm.v1.request.Request
    # Leading blocks that are in the store or already planned to be saved.
    stored: int = 0
    # Whether any save was planned: then its blocks stay allocated until every worker has
    # reported the request in finished_sending.
    saving: bool = False
    # The pending load, to rewind `stored` when a block of it fails.
    load: LoadJob | None = None
    load_start: int = 0


class SchedulerHalf:
    """Bookkeeping for the scheduler-side hooks; see `KVOffloadConnector` for each hook.

    Args:
        client: a client of the store (only `lookup` is used here).
        namespaces: for every tensor-parallel rank (rank 0 first), the namespace of each layer
            part of its blocks (one: whole blocks).
        block_tokens, hash_ratio: vLLM's block size and hashes per block.
    """

    def __init__(
        self,
        settings: Settings,
        client: Client,
        namespaces: Sequence[Sequence[Namespace]],
        block_tokens: int,
        hash_ratio: int,
        kv_cache_manager: Any = None,
        groups: GroupLookup | None = None,
        on_cpu: bool = False,
        async_scheduling: bool = False,
        state_groups: Sequence[int] = (),
    ) -> None:
        if async_scheduling and (settings.layer_parts > 1 or settings.sync_load_blocks > 0):
            # Step N+1 is scheduled before step N's failed loads are known: a request that
            # shares the prefix would read blocks vLLM has not yet marked for recomputing.
            raise ConfigError(
                "layer_parts > 1 and sync_load_blocks > 0 load blocks during the step that "
                "reads them, which vLLM's async scheduling cannot undo when a load fails: "
                "start vLLM with --no-async-scheduling, or leave both settings at their default"
            )
        self._settings = settings
        self._client = client
        self._namespaces = [list(parts) for parts in namespaces]
        self._block_tokens = block_tokens
        self._hash_ratio = hash_ratio
        self.kv_cache_manager = kv_cache_manager
        # Several KV cache groups or a sliding window: the lookup of connectors/vllm/groups.py.
        self._groups = groups
        # KV cache groups of Mamba / linear-attention state: their blocks are saved from
        # vLLM's boundary-state hand-offs, never from block table positions.
        self._state_groups = tuple(state_groups)
        self._num_groups = groups.num_groups if groups is not None else 1
        self._offers: dict[str, list[tuple[int, int, int]]] = {}
        # The largest load that runs before its step's forward instead of in the background.
        # Hybrid models report a failed load per request, which vLLM takes from asynchronous
        # loads only: theirs stay asynchronous.
        sync = settings.sync_load_blocks
        if sync < 0:
            sync = 1 << 30 if on_cpu and not async_scheduling else 0
        self._sync_blocks = 0 if groups is not None else sync
        if settings.layer_parts > 1:
            # Layer by layer: every load runs during its request's first forward.
            self._sync_blocks = 1 << 30
        self._requests: dict[str, _Request] = {}
        # req_id -> (first block not computed locally, leading blocks found in the store, the
        # tiers of the claimed blocks, whether the load is synchronous).
        self._lookups: dict[str, tuple[int, int, TierRun, bool]] = {}
        self._loads: list[LoadJob] = []
        self.claim = ClaimRule(block_tokens, settings.claim, settings.load_blocks_per_s,
                               settings.prefill_tokens_per_s,
                               parts=settings.layer_parts)  # fmt: skip

    def _hashes(self, request: Any) -> list[bytes]:
        return _compat.request_hashes(request, self._hash_ratio)

    def _stored_blocks(self, hashes: Sequence[bytes]) -> tuple[int, TierRun]:
        """Leading blocks that every rank has in the store, every layer part of them (one
        lookup per rank and part), and where rank 0's part 0 are (the other ranks' and parts'
        blocks are taken to be alike)."""
        if self._groups is not None:
            # Several KV cache groups: their tiers are not looked up, so the claim rule costs
            # the hit at the one rate hybrid loads measure (Tier.UNKNOWN).
            hit = self._groups.stored_blocks(self._client, hashes)
            return hit, TierRun.of(Tier.UNKNOWN, hit)
        hit = len(hashes)
        run = TierRun()
        for rank, parts in enumerate(self._namespaces):
            for part, ns in enumerate(parts):
                if hit == 0:
                    break
                keys = engine_keys(ns, hashes[:hit])
                if rank == 0 and part == 0:
                    run = self._client.lookup(keys, tiers=True)
                    hit = min(hit, run.total)
                else:
                    hit = min(hit, self._client.lookup(keys))
        return hit, run.slice(0, hit)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        size = self._block_tokens
        # The last prompt token is always computed: vLLM needs its logits.
        usable = (request.num_tokens - 1) // size
        start = num_computed_tokens // size
        if usable <= start:
            self._lookups[request.request_id] = (start, 0, TierRun(), False)
            return 0, False
        began = time.perf_counter()
        hit, run = self._stored_blocks(self._hashes(request)[:usable])
        # Tokens computed after the hit: with layer parts, loads hide under their compute.
        after = request.num_tokens - hit * size
        claimed = self.claim.claim_blocks(run.slice(start), after) if hit > start else 0
        sync = 0 < claimed <= self._sync_blocks
        self._lookups[request.request_id] = (start, hit, run.slice(start, start + claimed), sync)
        log.debug("kvoffload: lookup %s blocks=%d local=%d hit=%d claimed=%d sync=%s ms=%.1f",
                  request.request_id, usable, start, hit, claimed, sync,
                  (time.perf_counter() - began) * 1e3)  # fmt: skip
        if claimed <= 0:
            return 0, False  # the blocks stay known as stored: they are not saved again
        return claimed * size, not sync

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        state = self._requests.setdefault(req_id, _Request(request))
        state.request = request
        start, hit, tiers, sync = self._lookups.pop(req_id, (0, 0, TierRun(), False))
        state.stored = max(state.stored, hit)
        if num_external_tokens <= 0:
            return
        count = num_external_tokens // self._block_tokens
        hashes = self._hashes(request)[start : start + count]
        ids = tuple(tuple(group[start : start + count]) for group in block_ids)
        job = LoadJob(req_id, ids, tuple(hashes), tiers.slice(0, count), sync)
        state.load, state.load_start = job, start
        self._loads.append(job)

    def _state_offers(self, req_id: str, end: int) -> dict[int, dict[int, int]]:
        """This step's state blocks of a request: block position -> {group: block id}, for
        boundaries on whole blocks of at most `end` blocks (vLLM also hands off sub-block
        tails, which no block hash names)."""
        out: dict[int, dict[int, int]] = {}
        for group, block, tokens in self._offers.pop(req_id, ()):
            count, rest = divmod(int(tokens), self._block_tokens)
            if group in self._state_groups and not rest and 0 < count <= end:
                out.setdefault(count - 1, {})[int(group)] = int(block)
        return out

    def _state_ids(
        self, ids: list[list[int]], offers: dict[int, dict[int, int]], first: int, end: int
    ) -> tuple[tuple[int, ...], ...]:
        """Block ids of positions `first:end` of every group: state groups' from `offers`
        (NULL_BLOCK where vLLM handed off no state; taken entries leave `offers`), the other
        groups' from their block tables `ids`."""
        out = []
        for g in range(len(ids)):
            if g in self._state_groups:
                row = [offers.get(p, {}).pop(g, NULL_BLOCK) for p in range(first, end)]
            else:
                row = list(ids[g][first:end])
            out.append(tuple(row))
        return tuple(out)

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        saves: list[SaveJob] = []
        size = self._block_tokens
        self._offers = _compat.boundary_states(scheduler_output) if self._state_groups else {}
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            request = state.request
            # Blocks whose every token has its KV written once this step has run.
            done = request.num_computed_tokens + scheduled
            if self._settings.offload_prompt_only:
                done = min(done, request.num_prompt_tokens)
            hashes = self._hashes(request)
            end = min(done // size, len(hashes))
            offers = self._state_offers(req_id, end)
            first = state.stored
            if end > first:
                ids = _compat.scheduled_block_ids(scheduler_output, self.kv_cache_manager,
                                                  req_id)  # fmt: skip
                saves.append(
                    SaveJob(
                        req_id,
                        self._state_ids(ids, offers, first, end),
                        tuple(hashes[first:end]),
                        hashes[first - 1] if first else None,
                        _block_tokens(request, first, end, size),
                        _compat.lora_name(request),
                    )
                )
                state.stored, state.saving = end, True
            # States of boundaries whose KV was saved before (e.g. a prompt's checkpoint).
            left = sorted(p for p, groups in offers.items() if groups)
            if left:
                lo, hi = left[0], left[-1] + 1
                no_ids: list[list[int]] = [[NULL_BLOCK] * hi for _ in range(self._num_groups)]
                ids_lo_hi = self._state_ids(no_ids, offers, lo, hi)
                parent = hashes[lo - 1] if lo else None
                saves.append(SaveJob(req_id, ids_lo_hi, tuple(hashes[lo:hi]), parent))
                state.saving = True
        plan = StepPlan(
            loads=tuple(self._loads),
            saves=tuple(saves),
            preempted=frozenset(scheduler_output.preempted_req_ids or ()),
            scheduled_tokens=int(scheduler_output.total_num_scheduled_tokens),
        )
        self._loads = []
        return plan

    def loads_failed(self, invalid_block_ids: Iterable[int]) -> None:
        """Blocks of pending loads failed: they will be recomputed, so save them again."""
        invalid = set(invalid_block_ids)
        for state in self._requests.values():
            job = state.load
            if job is None:
                continue
            rows = enumerate(zip(*job.block_ids, strict=False))  # block ids of every group
            bad = [i for i, ids in rows if invalid.intersection(ids)]
            if bad:
                state.stored = min(state.stored, state.load_start + bad[0])
                log.info("request %s: %d block(s) failed to load and will be recomputed",
                         job.req_id, len(job.hashes) - bad[0])  # fmt: skip

    def requests_failed(self, req_ids: Iterable[str]) -> None:
        """Hybrid models: loads failed as a whole (vLLM recomputes those requests from their
        start), so save their loaded range again."""
        for req_id in req_ids:
            state = self._requests.get(req_id)
            if state is not None and state.load is not None:
                state.stored = min(state.stored, state.load_start)

    def loads_finished(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            state = self._requests.get(req_id)
            if state is not None:
                state.load = None

    def request_finished(self, request: Any) -> bool:
        """Whether the request's blocks must stay allocated until its saves are done."""
        self._lookups.pop(request.request_id, None)
        state = self._requests.pop(request.request_id, None)
        return state is not None and state.saving


def _block_tokens(request: Any, first: int, end: int, size: int) -> tuple[tuple[int, ...], ...]:
    """Token ids of blocks `first:end` of a request (empty when vLLM does not expose them)."""
    tokens = getattr(request, "all_token_ids", None)
    if tokens is None or len(tokens) < end * size:
        return ()
    return tuple(
        tuple(int(t) for t in tokens[i * size : (i + 1) * size]) for i in range(first, end)
    )
