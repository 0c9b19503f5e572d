"""The worker half of `KVOffloadConnector`: moves KV bytes between vLLM's paged cache and the
store, off the forward path.

Saves and loads run on background threads, one job at a time each, with their own staging
buffer of `batch_blocks` blocks. A save gathers a batch of blocks from every layer with one
tensor op and puts it in one pipelined `put_many`; a load reads a batch with one pipelined
`get_many_into` (each block verified in its staging row) and scatters it back with one tensor
op. A block that cannot be read (evicted, corrupt, store down) ends its load there: it and the
blocks after it are reported to vLLM, which recomputes them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvoffload.client_sdk import BlockHash, Client, Namespace, engine_hashes
from kvoffload.connectors.paged_kv import PagedKV
from kvoffload.connectors.vllm.claim import (
    MIN_PREFILL_TOKENS,
    KVOffloadStats,
    StepRates,
    load_batches,
)
from kvoffload.connectors.vllm.plan import LoadJob, SaveJob, Settings, StepPlan, block_metas
from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["WorkerHalf"]

log = logging.getLogger(__name__)


class WorkerHalf:
    """State and threads of one worker; see `KVOffloadConnector` for each hook."""

    def __init__(
        self,
        settings: Settings,
        client: Client,
        namespace: Namespace,
        layer_names: Sequence[str],
        num_blocks: int,
    ) -> None:
        self._settings = settings
        self._client = client
        self._namespace = namespace
        self._layer_names = list(layer_names)
        self._num_blocks = num_blocks
        self._kv: PagedKV | None = None
        self._save_buffer: torch.Tensor | None = None
        self._load_buffer: torch.Tensor | None = None
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
        self._rates = StepRates()  # under _lock: the loader thread adds to it
        self._step: tuple[float, int] | None = None  # forward start, tokens it computes

    # -- registration ---------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt vLLM's KV views (one per layer of the group) and check them against the
        namespace the scheduler computed keys with.

        Raises:
            ConfigError: a layer is missing or the views disagree with the namespace.
        """
        missing = [name for name in self._layer_names if name not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV cache for layers {missing}")
        kv = PagedKV([kv_caches[name] for name in self._layer_names], self._num_blocks)
        ns = self._namespace
        item = kv_caches[self._layer_names[0]].element_size()
        seen = (kv.block_tokens, kv.num_kv_heads, kv.width_bytes // item)
        expected = (ns.block_tokens, ns.num_kv_heads, ns.head_size)
        if seen != expected:
            raise ConfigError(
                f"KV views hold (tokens, heads, K+V width) = {seen} per block, the KV cache "
                f"config says {expected}"
            )
        self._kv = kv
        batch = self._settings.batch_blocks
        self._save_buffer = kv.staging(batch)
        self._load_buffer = kv.staging(batch)
        if kv.device.type == "cuda":
            self._save_stream = torch.cuda.Stream(kv.device)
            self._load_stream = torch.cuda.Stream(kv.device)
        log.info(
            "kvoffload: %d layers, %d blocks of %d bytes, staging %d blocks",
            kv.num_layers, kv.num_blocks, kv.block_bytes, batch,
        )  # fmt: skip

    @property
    def block_bytes(self) -> int:
        return self._kv.block_bytes if self._kv is not None else 0

    # -- per-step hooks -------------------------------------------------------------------

    def start_loads(self, plan: StepPlan) -> None:
        for job in plan.loads:
            self._loader.submit(self._run_load, job)
        # The forward runs between start_load_kv and wait_for_save; on a CPU it is done when
        # wait_for_save is called (a GPU's is not: there the prefill rate is told instead).
        on_cpu = self._kv is not None and self._kv.device.type == "cpu"
        if on_cpu and plan.scheduled_tokens >= MIN_PREFILL_TOKENS:
            self._step = (time.perf_counter(), plan.scheduled_tokens)

    def take_rates(self) -> KVOffloadStats | None:
        with self._lock:
            return self._rates.take()

    def submit_saves(self, plan: StepPlan) -> None:
        if self._step is not None:
            start, tokens = self._step
            self._step = None
            with self._lock:
                self._rates.prefill_tokens += tokens
                self._rates.prefill_s += time.perf_counter() - start
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
            self._save_futures.append(self._saver.submit(self._run_save, job, ready))

    def wait_for_saves(self) -> None:
        """Block until every submitted save has read its blocks (before vLLM reuses blocks
        of preempted requests, and at shutdown)."""
        futures, self._save_futures = self._save_futures, []
        for future in futures:
            future.result()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
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
        self._save_futures = [f for f in self._save_futures if not f.done()]
        return sent, received

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._reported_errors = self._reported_errors, set()
        return errors

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        self._client.close()

    # -- background work ------------------------------------------------------------------

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

    def _run_save(self, job: SaveJob, ready: torch.cuda.Event | None) -> None:
        try:
            self._save(job, ready)
        except KVOffloadError as exc:
            log.warning("kvoffload: saving blocks of %s failed: %s", job.req_id, exc)
        except Exception:
            # A thread boundary: a failed save is a future miss, never a failed step.
            log.exception("kvoffload: saving %d blocks of %s failed", len(job.hashes),
                          job.req_id)  # fmt: skip
        finally:
            with self._lock:
                self._pending_saves[job.req_id] -= 1

    def _save(self, job: SaveJob, ready: torch.cuda.Event | None) -> None:
        kv, buffer = self._kv, self._save_buffer
        assert kv is not None and buffer is not None, "register_kv_caches was not called"
        hashes = engine_hashes(self._namespace, job.hashes)
        parent: BlockHash | None = None
        if job.parent is not None:
            parent = engine_hashes(self._namespace, [job.parent])[0]
        # Another request may have saved the same prefix since the scheduler planned this.
        first = self._client.lookup(hashes)
        if first:
            parent = hashes[first - 1]
        batch = buffer.shape[0]
        for start in range(first, len(hashes), batch):
            chunk = hashes[start : start + batch]
            ids = torch.tensor(job.block_ids[start : start + len(chunk)], dtype=torch.long)
            with self._on(self._save_stream):
                if ready is not None and self._save_stream is not None:
                    self._save_stream.wait_event(ready)
                kv.gather(ids, buffer)
            parents = [parent, *chunk[:-1]]
            metas = block_metas(job, start, start + len(chunk))
            self._client.put_many(zip(chunk, buffer[: len(chunk)], strict=True), parents=parents,
                                  metas=metas)  # fmt: skip
            parent = chunk[-1]

    def _run_load(self, job: LoadJob) -> None:
        loaded = 0
        try:
            loaded = self._load(job)
        except KVOffloadError as exc:
            log.warning("kvoffload: loading blocks of %s failed: %s", job.req_id, exc)
        except Exception:
            # A thread boundary: the blocks are reported as failed and vLLM recomputes them.
            log.exception("kvoffload: loading %d blocks of %s failed", len(job.hashes),
                          job.req_id)  # fmt: skip
        if loaded < len(job.block_ids):
            log.warning(
                "kvoffload: request %s loaded %d of %d blocks; vLLM recomputes the rest",
                job.req_id, loaded, len(job.block_ids),
            )  # fmt: skip
        with self._lock:
            self._load_errors.update(job.block_ids[loaded:])
            self._loaded.add(job.req_id)

    def _load(self, job: LoadJob) -> int:
        """Read and scatter the job's blocks; returns how many leading blocks were loaded.
        Each staging batch holds blocks of one tier; its time goes to that tier's rate."""
        kv, buffer = self._kv, self._load_buffer
        assert kv is not None and buffer is not None, "register_kv_caches was not called"
        hashes = engine_hashes(self._namespace, job.hashes)
        for start, stop, tier in load_batches(len(hashes), buffer.shape[0], job.tiers):
            began = time.perf_counter()
            chunk = hashes[start:stop]
            ok = self._read_batch(chunk, buffer)
            if ok:
                ids = torch.tensor(job.block_ids[start : start + ok], dtype=torch.long)
                with self._on(self._load_stream):
                    kv.scatter(ids, buffer)
                with self._lock:
                    self._rates.loaded(tier, ok, time.perf_counter() - began)
            if ok < len(chunk):
                return start + ok
        return len(hashes)

    def _read_batch(self, keys: Sequence[BlockHash], buffer: torch.Tensor) -> int:
        """Verified blocks straight into the staging rows, in one pipelined batch; returns how
        many leading blocks can be used."""
        try:
            got = self._client.get_many_into(keys, [buffer[i] for i in range(len(keys))])
        except KVOffloadError as exc:
            log.warning("kvoffload: reading %d blocks failed: %s", len(keys), exc)
            return 0
        ok = 0
        while ok < len(got) and got[ok] == self.block_bytes:
            ok += 1
        if ok < len(got):
            key, size = keys[ok], got[ok]
            if size is not None:
                log.warning("kvoffload: block %s holds %d bytes, expected %d", key[:16].hex(),
                            size, self.block_bytes)  # fmt: skip
            # Missing or damaged: drop whatever is stored under the key, so that the recomputed
            # block is saved again instead of failing every later load.
            with contextlib.suppress(KVOffloadError):
                self._client.delete(key)
        return ok
