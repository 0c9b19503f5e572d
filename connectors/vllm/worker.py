"""The worker half of `KVOffloadConnector`: moves KV bytes between vLLM's paged cache and the
store, off the forward path.

Saves and loads run on background threads, one job at a time each, with their own staging
buffer of `batch_blocks` blocks; a load the scheduler marked synchronous (small, or on a CPU)
runs in `start_load_kv` instead, before the forward that reads it. A save gathers a batch of
blocks from every layer with one tensor op and puts it in one pipelined `put_many`; a load
reads a batch with one pipelined `get_many_into` (each block verified in its staging row) and
copies it into vLLM's KV cache (one tensor op on a GPU, one copy per block on a CPU). A block
that cannot be read (evicted, corrupt, store down) ends its load there: it and the blocks after
it are reported to vLLM, which recomputes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvoffload.client_sdk import Client, Namespace, Tier, TierRun, engine_hashes
from kvoffload.connectors.vllm.claim import (
    MIN_PREFILL_TOKENS,
    KVOffloadStats,
    StepRates,
    load_batches,
)
from kvoffload.connectors.vllm.groups import (
    GroupKV,
    chain_hashes,
    on_stream,
    read_batch,
    stored_positions,
)
from kvoffload.connectors.vllm.layers import LayerLoad
from kvoffload.connectors.vllm.plan import (
    FULL,
    NULL_BLOCK,
    KVGroup,
    LoadJob,
    SaveJob,
    Settings,
    StepPlan,
    block_metas,
)
from kvoffload.connectors.vllm.state import DAMAGE, ZERO_UNVERIFIED, damage_part, planted_fault
from kvoffload.errors import KVOffloadError

__all__ = ["WorkerHalf"]

log = logging.getLogger(__name__)


class WorkerHalf:
    """State and threads of one worker; see `KVOffloadConnector` for each hook."""

    def __init__(
        self,
        settings: Settings,
        client: Client,
        namespaces: Sequence[Namespace],
        groups: Sequence[KVGroup],
        num_blocks: int,
        layered: bool = False,
    ) -> None:
        self._settings = settings
        self._client = client
        # One per KV cache group, or with `layered` one per layer part of the model's one
        # group (connectors/vllm/layers.py).
        self._namespaces = list(namespaces)
        self._groups_spec = list(groups)
        self._num_blocks = num_blocks
        self._groups: list[GroupKV] = []
        self._layered = layered
        self._layer_load: LayerLoad | None = None  # this step's layer-wise load
        self._layer_waited_s = 0.0  # time this step's forward waited for it
        # Hybrid models report a failed load per request: vLLM cannot map a block id back to
        # its request when ids repeat across groups.
        self._hybrid = len(groups) > 1 and not layered
        # The group whose saves carry token ids for the store's KV events (one is enough;
        # with layer parts the last, saved once the others are).
        self._events_group = next((i for i, g in enumerate(groups) if g.kind == FULL), 0)
        if layered:
            self._events_group = len(groups) - 1
        self._save_stream: torch.cuda.Stream | None = None
        self._load_stream: torch.cuda.Stream | None = None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-save")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-load")
        self._lock = threading.Lock()
        self._save_futures: list[Future[None]] = []
        self._pending_saves: dict[str, int] = {}  # req_id -> save jobs not finished
        self._saving: set[str] = set()  # requests with saves, not yet reported finished
        self._finished_saving: set[str] = set()  # finished requests waiting for their saves
        self._loaded: set[str] = set()  # loads done since the last get_finished
        self._load_errors: set[int] = set()  # failed blocks of those loads
        self._reported_errors: set[int] = set()
        self._failed: set[str] = set()  # hybrid models: requests whose load failed
        self._reported_failed: set[str] = set()
        self._rates = StepRates()  # under _lock: the loader thread adds to it
        self._step: tuple[float, int] | None = None  # forward start, tokens it computes
        self._step_began: float | None = None  # when vLLM bound the current step's plan

    # -- registration ---------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt vLLM's KV views (every layer of every group) and check them against the
        namespaces the scheduler computed keys with.

        Raises:
            ConfigError: a layer is missing or the views disagree with the namespace.
        """
        batch = self._settings.batch_blocks
        self._groups = [
            GroupKV.adopt(
                group, ns, kv_caches, self._num_blocks, batch, 0 if self._layered else g
            )  # fmt: skip
            for g, (group, ns) in enumerate(zip(self._groups_spec, self._namespaces, strict=True))
        ]
        device = self._groups[0].kv.device
        if device.type == "cuda":
            self._save_stream = torch.cuda.Stream(device)
            self._load_stream = torch.cuda.Stream(device)
        for g, part in enumerate(self._groups):
            log.info(
                "kvoffload: group %d (%s): %d layers, %d tokens per block, %d blocks of %d "
                "bytes, staging %d blocks, window %s", g, part.group.kind, part.kv.num_layers,
                part.namespace.block_tokens, part.kv.num_blocks, part.kv.block_bytes, batch,
                part.group.sliding_window,
            )  # fmt: skip

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the first group (0 before `register`)."""
        return self._groups[0].kv.block_bytes if self._groups else 0

    # -- per-step hooks -------------------------------------------------------------------

    def begin_step(self) -> None:
        """vLLM bound this step's plan: its forward starts now or after the sync loads."""
        self._step_began = time.perf_counter()

    def start_loads(self, plan: StepPlan) -> None:
        began = self._step_began
        if self._layered and plan.loads:
            # Layer by layer: the forward starts now, each attention layer waiting for its part.
            self._layer_load = LayerLoad(plan.loads, self._groups, self._client,
                                         self._load_stream,
                                         self._settings.layer_load_timeout_s)  # fmt: skip
            self._loader.submit(self._layer_load.run)
            began = time.perf_counter()
        for job in () if self._layered else plan.loads:
            if job.sync:
                # This step's forward reads these blocks: load them before it starts.
                self._run_load(job)
                began = time.perf_counter()
            else:
                self._loader.submit(self._run_load, job, time.perf_counter())
        # The forward runs between binding the plan (or the end of the sync loads, which vLLM
        # starts before it) and wait_for_save; vLLM calls start_load_kv after the forward when
        # no load is synchronous. On a CPU the forward is done when wait_for_save is called (a
        # GPU's is not: there the prefill rate is told instead).
        on_cpu = bool(self._groups) and self._groups[0].kv.device.type == "cpu"
        if on_cpu and plan.scheduled_tokens >= MIN_PREFILL_TOKENS and began is not None:
            self._step = (began, plan.scheduled_tokens)
        self._step_began = None

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until `layer_name`'s part of this step's loads is in vLLM's KV cache."""
        if self._layer_load is not None:
            self._layer_load.wait(layer_name)

    def _finish_layer_load(self) -> None:
        """Join this step's layer-wise load so its failed blocks go out with this step's
        output (`get_finished` runs after the forward, before `wait_for_save` in spec decode)."""
        load, self._layer_load = self._layer_load, None
        if load is None:
            return
        loaded = load.finish()
        with self._lock:
            load.rates.into(self._rates, len(self._groups))
            for job, count in zip(load.jobs, loaded, strict=True):
                if count < len(job.hashes):
                    log.warning("kvoffload: request %s loaded %d of %d blocks; vLLM "
                                "recomputes the rest", job.req_id, count,
                                len(job.hashes))  # fmt: skip
                    self._load_errors.update(b for b in job.block_ids[0][count:]
                                             if b != NULL_BLOCK)  # fmt: skip
        self._layer_waited_s += load.waited_s

    def take_rates(self) -> KVOffloadStats | None:
        with self._lock:
            return self._rates.take()

    def submit_saves(self, plan: StepPlan) -> None:
        ended = time.perf_counter()
        self._finish_layer_load()  # also joined by get_finished when spec decode runs first
        waited, self._layer_waited_s = self._layer_waited_s, 0.0
        if self._step is not None:
            start, tokens = self._step
            self._step = None
            with self._lock:
                self._rates.prefill_tokens += tokens
                # Time blocked on layer loads is not compute.
                self._rates.prefill_s += max(0.0, ended - start - waited)
        if not plan.saves:
            return
        # The saves read KV the forward just wrote: on a GPU, order them after it.
        ready = None
        if self._save_stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        with self._lock:
            for job in plan.saves:
                self._pending_saves[job.req_id] = self._pending_saves.get(job.req_id, 0) + 1
                self._saving.add(job.req_id)
        for job in plan.saves:
            snapshots = _snapshots(self._groups, job)
            self._save_futures.append(self._saver.submit(self._run_save, job, ready, snapshots))

    def wait_for_saves(self) -> None:
        """Block until every submitted save has read its blocks (preemptions, shutdown)."""
        futures, self._save_futures = self._save_futures, []
        for future in futures:
            future.result()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._finish_layer_load()
        with self._lock:
            for req_id in finished_req_ids:
                if req_id in self._saving:
                    self._saving.discard(req_id)
                    self._finished_saving.add(req_id)
            sent = {r for r in self._finished_saving if not self._pending_saves.get(r)}
            self._finished_saving -= sent
            for req_id in sent:
                self._pending_saves.pop(req_id, None)
            received, self._loaded = self._loaded, set()
            # Errors are handed out with (never after) the loads they belong to.
            self._reported_errors |= self._load_errors
            self._load_errors = set()
            self._reported_failed |= self._failed
            self._failed = set()
        self._save_futures = [f for f in self._save_futures if not f.done()]
        return sent, received

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._reported_errors = self._reported_errors, set()
        return errors

    def take_failed(self) -> set[str]:
        """Hybrid models: requests whose load failed, handed out with their `get_finished`."""
        with self._lock:
            failed, self._reported_failed = self._reported_failed, set()
        return failed

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        self._client.close()

    # -- background work ------------------------------------------------------------------

    def _run_save(
        self, job: SaveJob, ready: torch.cuda.Event | None, snapshots: dict[int, torch.Tensor]
    ) -> None:
        try:
            for g, part in enumerate(self._groups):
                _save_group(self._client, self._save_stream, part, job.block_ids[part.index], job,
                            ready, snapshots.get(g), g == self._events_group)  # fmt: skip
        except KVOffloadError as exc:
            log.warning("kvoffload: saving blocks of %s failed: %s", job.req_id, exc)
        except Exception:
            # A thread boundary: a failed save is a future miss, never a failed step.
            log.exception("kvoffload: saving %d blocks of %s failed", len(job.hashes),
                          job.req_id)  # fmt: skip
        finally:
            with self._lock:
                self._pending_saves[job.req_id] -= 1

    def _run_load(self, job: LoadJob, queued: float | None = None) -> None:
        loaded = 0
        clock = _LoadClock(time.perf_counter())
        try:
            loaded = self._load(job, clock)
        except KVOffloadError as exc:
            log.warning("kvoffload: loading blocks of %s failed: %s", job.req_id, exc)
        except Exception:
            # A thread boundary: the blocks are reported as failed and vLLM recomputes them.
            log.exception("kvoffload: loading %d blocks of %s failed", len(job.hashes),
                          job.req_id)  # fmt: skip
        if loaded < len(job.hashes):
            log.warning(
                "kvoffload: request %s loaded %d of %d blocks; vLLM recomputes the rest",
                job.req_id, loaded, len(job.hashes),
            )  # fmt: skip
        clock.log(job, loaded, queued)
        with self._lock:
            if loaded < len(job.hashes) and self._hybrid:
                self._failed.add(job.req_id)
            elif loaded < len(job.hashes):
                self._load_errors.update(b for b in job.block_ids[0][loaded:] if b != NULL_BLOCK)
            if not job.sync:
                # vLLM expects finished_recving only for requests waiting for their load.
                self._loaded.add(job.req_id)

    def _load(self, job: LoadJob, clock: _LoadClock) -> int:
        """Read and scatter the job's blocks, group by group; returns how many leading block
        positions every group loaded (a failure in one group ends the load for all). With one
        group each staging batch holds blocks of one tier and its time goes to that tier's
        rate; a hybrid model's tiers are not looked up, so its loads time whole jobs."""
        if not self._hybrid:
            return self._load_group(self._groups[0], job.hashes, job.block_ids[0], job.tiers,
                                    clock)  # fmt: skip
        began, end = time.perf_counter(), len(job.hashes)
        for part, ids in zip(self._groups, job.block_ids, strict=True):
            if part.group.is_state:
                end = self._load_state(part, job, ids, end, clock)
                continue
            end = self._load_group(part, job.hashes[:end], ids[:end], None, clock)
        if end:
            with self._lock:
                self._rates.loaded(Tier.UNKNOWN, end, time.perf_counter() - began)
        return end

    def _load_state(
        self, part: GroupKV, job: LoadJob, ids: Sequence[int], end: int, clock: _LoadClock
    ) -> int:
        """Load a state group's one block of a hit: the state at its boundary (the job's last
        block), into the block vLLM allocated for it. Returns `end` when it is in place, else
        0: without its state no block of the hit can be used."""
        last = len(job.hashes) - 1
        if end <= last or ids[last] == NULL_BLOCK:
            if end > last:
                log.warning("kvoffload: request %s has no state block at its hit boundary",
                            job.req_id)  # fmt: skip
            return 0
        if planted_fault(take_damage=True) == DAMAGE:
            damage_part(self._client, engine_hashes(part.namespace, [job.hashes[last]])[0])
        masked = [NULL_BLOCK] * last + [ids[last]]
        if self._load_group(part, job.hashes, masked, None, clock) <= last:
            return 0
        if planted_fault() == ZERO_UNVERIFIED:
            zeros = part.kv.staging(1).zero_()
            part.kv.scatter(torch.tensor([ids[last]], dtype=torch.long), zeros)
        return end

    def _load_group(
        self,
        part: GroupKV,
        hashes: Sequence[bytes],
        ids: Sequence[int],
        run: TierRun | None,
        clock: _LoadClock,
    ) -> int:
        positions = stored_positions(ids)
        keys = engine_hashes(part.namespace, [hashes[p] for p in positions])
        buffer = part.load_buffer
        tiers = run.tiers() if run is not None else []
        tiers += [Tier.UNKNOWN] * (len(hashes) - len(tiers))
        segments = TierRun.from_tiers(tiers[p] for p in positions)
        for start, stop, tier in load_batches(len(keys), buffer.shape[0], segments):
            began = time.perf_counter()
            chunk = keys[start:stop]
            ok = read_batch(self._client, chunk, buffer, part.kv.block_bytes)
            read = time.perf_counter()
            clock.read_s += read - began
            if ok:
                block_ids = torch.tensor([ids[p] for p in positions[start : start + ok]],
                                         dtype=torch.long)  # fmt: skip
                with on_stream(self._load_stream):
                    part.kv.scatter(block_ids, buffer)
                clock.scatter_s += time.perf_counter() - read
                if run is not None:
                    with self._lock:
                        self._rates.loaded(tier, ok, time.perf_counter() - began)
            if ok < len(chunk):
                return positions[start + ok]
        return len(hashes)


def _save_group(
    client: Client,
    stream: torch.cuda.Stream | None,
    part: GroupKV,
    ids: Sequence[int],
    job: SaveJob,
    ready: torch.cuda.Event | None,
    snapshot: torch.Tensor | None,
    events: bool,
) -> None:
    """Save one group's blocks of a job (rows of `snapshot`, if taken, else its blocks)."""
    positions = stored_positions(ids)
    if not positions:
        return
    chain, before = chain_hashes(part.namespace, job.hashes, job.parent)
    hashes = [chain[p] for p in positions]
    # Another request may have saved the same prefix since the scheduler planned this.
    first = client.lookup(hashes)
    metas = block_metas(job, 0, len(job.hashes)) if events else None
    buffer = part.save_buffer
    batch = buffer.shape[0]
    for start in range(first, len(positions), batch):
        pos = positions[start : start + batch]
        if snapshot is not None:
            rows = snapshot[start : start + len(pos)]
        else:
            block_ids = torch.tensor([ids[p] for p in pos], dtype=torch.long)
            with on_stream(stream):
                if ready is not None and stream is not None:
                    stream.wait_event(ready)
                part.kv.gather(block_ids, buffer)
            rows = buffer[: len(pos)]
        parents = [chain[p - 1] if p else before for p in pos]
        client.put_many(zip(hashes[start : start + len(pos)], rows, strict=True),
                              parents=parents,
                              metas=[metas[p] for p in pos] if metas else None)  # fmt: skip


@dataclass
class _LoadClock:
    """Where one load's time went (logged at debug level)."""

    start: float
    read_s: float = 0.0  # get_many_into: transfer and verification
    scatter_s: float = 0.0  # staging rows into vLLM's KV cache

    def log(self, job: LoadJob, loaded: int, queued: float | None) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        # `bench/serve/breakdown.py` reads these lines for its TTFT breakdown.
        waited = self.start - queued if queued is not None else 0.0
        log.debug(
            "kvoffload: load %s %s blocks=%d/%d queued_ms=%.1f read_ms=%.1f scatter_ms=%.1f "
            "total_ms=%.1f", job.req_id, "sync" if job.sync else "async", loaded,
            len(job.hashes), waited * 1e3, self.read_s * 1e3, self.scatter_s * 1e3,
            (time.perf_counter() - self.start) * 1e3,
        )  # fmt: skip


def _snapshots(groups: Sequence[GroupKV], job: SaveJob) -> dict[int, torch.Tensor]:
    """Copies of a job's sliding-window and state blocks, taken before the next step can free
    them (full-attention blocks stay allocated until `get_finished` reports the request; a
    state block vLLM handed off holds its boundary only until the next step runs)."""
    out: dict[int, torch.Tensor] = {}
    for g, part in enumerate(groups):
        ids = job.block_ids[part.index]
        kept = [ids[i] for i in stored_positions(ids)]
        if part.group.kind != FULL and kept:
            out[g] = part.snapshot(kept)
    return out
