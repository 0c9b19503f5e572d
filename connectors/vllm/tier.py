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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from kvoffload.client_sdk import BlockHash, Client, Namespace, engine_hashes
from kvoffload.client_sdk.keys import DTYPE_BYTES
from kvoffload.connectors.vllm import _compat
from kvoffload.errors import KVOffloadError

__all__ = ["KVOffloadTier"]

log = logging.getLogger(__name__)


def tier_namespace(spec: Any, chunk_bytes: int, hash_algo: str, salt: str) -> Namespace:
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
    )


class _Lookups(_compat.AsyncLookupManager):
    """vLLM's non-blocking lookup cache, answered with one store lookup per request."""

    def __init__(self, tier: KVOffloadTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[bytes], req_context: Any) -> Iterable[bool]:
        # vLLM asks for a request's chunks in chain order and stops at the first miss, so a
        # prefix count answers it; a chunk after a gap reads as a miss (never a false hit).
        hit = self._tier.client.lookup(self._tier.hashes(keys))
        return [i < hit for i in range(len(keys))]


class KVOffloadTier(_compat.SecondaryTierManager):
    """A `SecondaryTierManager` backed by a kvoffload store.

    Args (tier config keys besides ``type`` and ``module_path``):
        url: the store, e.g. ``kv://127.0.0.1:7480``.
        salt: deployment salt mixed into every key.
        hash_algo: vLLM's prefix-caching hash, used only when the tier cannot read vLLM's
            config (it can inside vLLM).
        io_threads: transfer jobs that run at once.
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
        backpressure_detector: Any = None,
        locality: str | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        algo = _compat.tier_hash_algo(hash_algo)
        self.namespace = tier_namespace(offloading_spec, self.block_size_bytes, algo, salt)
        self.client = Client.connect(url, namespace=self.namespace)
        self._chunks = primary_kv_view.cast("B")
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-tier")
        self._lock = threading.Lock()
        self._finished: list[Any] = []
        self._missing: list[bytes] = []  # keys of failed loads, for the lookup cache
        self._running = 0
        self._idle = threading.Condition(self._lock)
        self._lookups = _Lookups(self, tier_type)

    def hashes(self, keys: Sequence[bytes]) -> list[BlockHash]:
        """Store hashes of vLLM offload keys (block hash + group id)."""
        return engine_hashes(self.namespace, [bytes(k) for k in keys])

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
        keys = list(job.keys)
        hashes = self.hashes(keys)
        chunks = [self._chunk(int(c)) for c in job.chunk_ids]
        parents: list[bytes | None] = [None, *hashes[:-1]]
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
