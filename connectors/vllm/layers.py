"""Blocks stored as layer parts, and the per-step load that hands the forward one part at a time.

With ``layer_parts = P > 1`` the worker stores each block as P values: part i holds a
contiguous run of the model's layers (sizes differ by at most one) under its own namespace,
whose layout names the part and its layers, so a part never answers for another part or for a
whole block. Each part is sealed and verified on its own by the store and the SDK, like any
block.

A step's loads then run on the loader thread while its forward runs: part 0 of every block of
the step (one `get_many_into` per staging batch, each row verified before it is scattered),
then part 1, and so on; after each part the loader marks it ready (on a GPU: a CUDA event
recorded on its load stream). Attention layer l calls `wait_for_layer_load`, which waits
only for the part holding l. A block that fails in any part (missing, damaged, wrong size,
store down) and every later block of its request are reported to vLLM, which discards what the
step computed for that request and recomputes from the first failed block
(`Scheduler._handle_invalid_blocks`); the parts after a failure are still marked ready, so the
forward never waits on them. A wait is bounded (`layer_load_timeout_s`): past it the load is
cancelled, nothing more is scattered, and every block of the step is reported failed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvoffload.client_sdk import Client, Tier, engine_hashes
from kvoffload.connectors.vllm.claim import StepRates, load_batches
from kvoffload.connectors.vllm.groups import GroupKV, on_stream, read_batch
from kvoffload.connectors.vllm.plan import KVGroup, LoadJob
from kvoffload.errors import ConfigError

__all__ = ["LayerLoad", "part_groups", "part_layout", "split_layers"]

log = logging.getLogger(__name__)


def split_layers(num_layers: int, parts: int) -> list[range]:
    """`parts` contiguous runs of layer indices covering `num_layers`, the first ones one
    layer longer where they cannot all be equal.

    Raises:
        ConfigError: fewer than one part, or more parts than layers.
    """
    if parts < 1:
        raise ConfigError(f"layer_parts must be at least 1, got {parts}")
    if parts > num_layers:
        raise ConfigError(f"layer_parts={parts} is more than the model's {num_layers} layers")
    base, longer = divmod(num_layers, parts)
    out: list[range] = []
    start = 0
    for index in range(parts):
        stop = start + base + (1 if index < longer else 0)
        out.append(range(start, stop))
        start = stop
    return out


def part_layout(layout: str, index: int, parts: int, layers: range) -> str:
    """The namespace layout of part `index` of `parts`: unchanged for one part (whole blocks
    keep the keys they always had), else tagged with the part and its layers."""
    if parts == 1:
        return layout
    return f"{layout};part={index}/{parts};layers={layers.start}-{layers.stop - 1}"


def part_groups(group: KVGroup, parts: int) -> list[KVGroup]:
    """`group` cut into `parts` groups of contiguous layers, in model order.

    Raises:
        ConfigError: as `split_layers`.
    """
    names = group.layer_names
    return [dataclasses.replace(group, layer_names=tuple(names[r.start : r.stop]))
            for r in split_layers(len(names), parts)]  # fmt: skip


@dataclass
class _Rates:
    """Part-blocks loaded and loader seconds, per tier (turned into whole blocks at the end)."""

    part_blocks: dict[Tier, int] = field(default_factory=dict)
    seconds: dict[Tier, float] = field(default_factory=dict)

    def add(self, tier: Tier, blocks: int, seconds: float) -> None:
        self.part_blocks[tier] = self.part_blocks.get(tier, 0) + blocks
        self.seconds[tier] = self.seconds.get(tier, 0.0) + seconds

    def into(self, rates: StepRates, parts: int) -> None:
        """Whole blocks (every part) per second of loader time, as whole-block loads count."""
        for tier, seconds in self.seconds.items():
            blocks = round(self.part_blocks.get(tier, 0) / parts)
            if blocks:
                rates.loaded(tier, blocks, seconds)


class LayerLoad:
    """One step's loads, part by part, on the loader thread (`run`), while the forward waits
    per layer (`wait`) and `finish` collects what loaded.

    Args:
        jobs: the step's loads (one KV cache group: `block_ids[0]`).
        parts: the worker's part views, in layer order.
        client: the store.
        stream: the loader's CUDA stream (None on a CPU).
        timeout_s: the longest the forward may wait, from now.
    """

    def __init__(
        self,
        jobs: Sequence[LoadJob],
        parts: Sequence[GroupKV],
        client: Client,
        stream: torch.cuda.Stream | None,
        timeout_s: float,
    ) -> None:
        self.jobs = list(jobs)
        self._parts = list(parts)
        self._client = client
        self._stream = stream
        self._deadline = time.monotonic() + timeout_s
        self._part_of = {name: p for p, part in enumerate(parts)
                         for name in part.group.layer_names}  # fmt: skip
        # Leading blocks of each job that every part so far loaded.
        self._limits = [len(job.hashes) for job in jobs]
        self._ready = [threading.Event() for _ in parts]
        self._events: list[torch.cuda.Event | None] = [None] * len(parts)
        self._done = threading.Event()
        self._waited: set[int] = set()  # parts the forward waited for
        # Scatters happen under this lock and only while not cancelled: once `_cancel`
        # returns, nothing more is written into vLLM's KV cache.
        self._lock = threading.Lock()
        self._cancelled = False
        self._completed = 0  # parts finished before any cancel
        self.rates = _Rates()
        self.waited_s = 0.0  # forward time spent blocked in `wait`

    # -- the loader thread ------------------------------------------------------------------

    def run(self) -> None:
        try:
            for p, part in enumerate(self._parts):
                for j, job in enumerate(self.jobs):
                    if self._cancelled:
                        return
                    if self._limits[j]:
                        try:
                            loaded = self._load_part(part, job, self._limits[j])
                        except Exception:
                            # A thread boundary: the job's blocks are reported as failed.
                            log.exception("kvoffload: loading layer part %d of %s failed", p,
                                          job.req_id)  # fmt: skip
                            loaded = 0
                        self._limits[j] = min(self._limits[j], loaded)
                self._mark(p)
        finally:
            # Whatever happened, no forward waits on a part that will never come.
            for ready in self._ready:
                ready.set()
            self._done.set()

    def _mark(self, p: int) -> None:
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._events[p] = event
        with self._lock:
            if not self._cancelled:
                self._completed = p + 1
        self._ready[p].set()

    def _load_part(self, part: GroupKV, job: LoadJob, limit: int) -> int:
        """Read and scatter this part of the job's first `limit` blocks; returns how many
        leading blocks of them it loaded."""
        keys = engine_hashes(part.namespace, job.hashes[:limit])
        ids = job.block_ids[0]
        buffer = part.load_buffer
        for start, stop, tier in load_batches(limit, buffer.shape[0], job.tiers):
            began = time.perf_counter()
            ok = read_batch(self._client, keys[start:stop], buffer, part.kv.block_bytes)
            if ok:
                block_ids = torch.tensor(ids[start : start + ok], dtype=torch.long)
                with self._lock:
                    if self._cancelled:
                        return start
                    with on_stream(self._stream):
                        part.kv.scatter(block_ids, buffer)
            self.rates.add(tier, ok, time.perf_counter() - began)
            if ok < stop - start:
                return start + ok
        return limit

    # -- the forward ----------------------------------------------------------------------

    def wait(self, layer_name: str) -> None:
        """Block until the part holding `layer_name` is loaded (at once for other layers);
        on a GPU, order the current stream after its scatter."""
        p = self._part_of.get(layer_name)
        if p is None:
            return
        self._waited.add(p)
        began = time.monotonic()
        ready = self._ready[p].wait(max(0.0, self._deadline - began))
        self.waited_s += time.monotonic() - began
        if not ready:
            log.warning("kvoffload: layer part %d not loaded after the layer-load timeout; "
                        "the step's loaded blocks are reported failed", p)  # fmt: skip
            self._cancel()
            return
        event = self._events[p]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def _cancel(self) -> None:
        with self._lock:
            self._cancelled = True
        for ready in self._ready:
            ready.set()

    def finish(self) -> list[int]:
        """After the forward: wait for the load (within the deadline) and return, per job,
        the leading blocks the forward could use. A part the forward never waited for may
        have been read before it was loaded, so then nothing counts as loaded."""
        if not self._done.wait(max(0.0, self._deadline - time.monotonic())):
            log.warning("kvoffload: the step's layer-wise load outlived its timeout")
            self._cancel()
        with self._lock:
            complete = self._completed == len(self._parts) and not self._cancelled
        if complete and len(self._waited) < len(self._parts):
            log.warning(
                "kvoffload: the forward did not wait for layer parts %s; their blocks "
                "are recomputed",
                sorted(set(range(len(self._parts))) - self._waited),
            )
            complete = False
        return list(self._limits) if complete else [0] * len(self.jobs)
