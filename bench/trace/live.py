"""Live replay: a trace's requests against a running store at their arrival times, compressed.

Request i starts at `arrival_i / speedup` seconds after the first (or as soon as a worker is
free, when the store falls behind: the start lag is reported). Each request looks up its chain,
loads the hit blocks in one batch (`get_many_into`, as the vLLM connector does) and checks them
bit for bit, then stores the blocks it had to compute, with parent keys, in one `put_many`.
Its load latency is the lookup plus that batch. Each worker thread has its own client; requests
run concurrently, so hits differ from the in-order replay. An exception of a request is counted
(with its message) and the run goes on; a loaded block whose bytes differ is a wrong block,
never a hit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvoffload.bench.trace.replay import Payloads
from kvoffload.client_sdk import BlockKey, Client, Namespace
from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["LiveResult", "live_replay"]


@dataclass
class LiveResult:
    load_s: npt.NDArray[np.float64]  # per request: lookup + batched load of its hits
    lag_s: npt.NDArray[np.float64]  # per request: how late it started against its schedule
    hit_blocks: npt.NDArray[np.int64]
    speedup: float
    workers: int
    wall_s: float
    errors: int = 0
    wrong_blocks: int = 0
    messages: list[str] = field(default_factory=list)  # the first few errors

    def summary(self) -> dict[str, object]:
        ok = self.load_s[np.isfinite(self.load_s)] * 1e3
        return {
            "requests": len(self.load_s),
            "speedup": self.speedup,
            "workers": self.workers,
            "wall_s": round(self.wall_s, 3),
            "load_p50_ms": round(float(np.median(ok)), 3) if ok.size else None,
            "load_p99_ms": round(float(np.quantile(ok, 0.99)), 3) if ok.size else None,
            "lag_p99_ms": round(float(np.quantile(self.lag_s, 0.99)) * 1e3, 3),
            "hit_blocks": int(self.hit_blocks.sum()),
            "errors": self.errors,
            "wrong_blocks": self.wrong_blocks,
            "messages": self.messages,
        }


def live_replay(
    url: str,
    namespace: Namespace,
    chains: Sequence[Sequence[BlockKey]],
    arrivals: Sequence[float],
    payloads: Payloads,
    *,
    speedup: float,
    workers: int = 8,
) -> LiveResult:
    """Replay `chains` against the store at `url` (module doc).

    Raises:
        ConfigError: `speedup` or `workers` is not positive, or the lists differ in length.
    """
    if not speedup > 0 or workers < 1:
        raise ConfigError("a live replay needs speedup > 0 and at least one worker")
    if len(chains) != len(arrivals):
        raise ConfigError("one arrival time per request chain")
    n = len(chains)
    load = np.full(n, np.nan)
    lag = np.zeros(n)
    hits = np.zeros(n, dtype=np.int64)
    lock = threading.Lock()
    counters = {"errors": 0, "wrong": 0}
    messages: list[str] = []
    local = threading.local()
    first = arrivals[0] if n else 0.0
    start = time.perf_counter()

    def client() -> Client:
        if not hasattr(local, "client"):
            local.client = Client.connect(url, namespace=namespace)
            clients.append(local.client)
        c: Client = local.client
        return c

    def one(i: int) -> None:
        due = start + (arrivals[i] - first) / speedup
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        lag[i] = max(0.0, time.perf_counter() - due)
        keys = chains[i]
        try:
            c = client()
            t0 = time.perf_counter()
            found = c.lookup(keys)
            bufs = [np.empty(payloads.size, dtype=np.uint8) for _ in range(found)]
            got = c.get_many_into(keys[:found], bufs) if found else []
            load[i] = time.perf_counter() - t0
            loaded, wrong = 0, 0
            for key, size, buf in zip(keys[:found], got, bufs, strict=True):
                if size is None:
                    break  # gone since the lookup: the hit ends here
                if size != payloads.size or not payloads.matches(key, buf):
                    wrong += 1
                    break
                loaded += 1
            hits[i] = loaded
            rest = range(loaded, len(keys))
            if rest:
                c.put_many([(keys[j], payloads.fresh(keys[j])) for j in rest],
                           parents=[keys[j - 1] if j else None for j in rest])  # fmt: skip
            if wrong:
                with lock:
                    counters["wrong"] += wrong
        except (KVOffloadError, OSError) as exc:
            with lock:
                counters["errors"] += 1
                if len(messages) < 5:
                    messages.append(f"request {i}: {type(exc).__name__}: {exc}")

    clients: list[Client] = []
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, range(n)))
    finally:
        for c in clients:
            c.close()
    return LiveResult(load, lag, hits, speedup, workers, time.perf_counter() - start,
                      counters["errors"], counters["wrong"], messages)  # fmt: skip
