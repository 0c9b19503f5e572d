"""Live replay: a trace's requests against a running store at their arrival times, compressed.

Request i starts at `arrival_i / speedup` seconds after the first (or as soon as a worker is
free, when the store falls behind: the start lag is reported). Each request looks up its chain,
loads the hit blocks in one batch (`get_many_into`, as the vLLM connector does) and checks them
bit for bit, then stores the blocks it had to compute, with parent keys, in one `put_many`.
Its load latency is the lookup plus that batch. Each worker thread has its own client; requests
run concurrently, so hits differ from the in-order replay. An exception of a request's load is an
error (counted, with its message) and the run goes on; an exception of its store is counted
apart (`store_errors`): the request was served, its blocks were not offloaded, as a connector
counts a put that raised. A loaded block whose bytes differ is a wrong block, never a hit.

`events` run on a thread of their own at their replay time (a fault, mid-run); `windows` cuts
the load latencies into 1 s windows of completion time around such an instant: the p99 before it,
each window's p99, and how long after it the windows stayed above `factor` times that p99.
An exception (Ctrl-C) stops the requests not yet started and is raised once those running end.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvoffload.bench.trace.replay import Payloads
from kvoffload.client_sdk import BlockKey, Client, Namespace
from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["LiveResult", "live_replay", "windows"]


@dataclass
class LiveResult:
    load_s: npt.NDArray[np.float64]  # per request: lookup + batched load of its hits
    lag_s: npt.NDArray[np.float64]  # per request: how late it started against its schedule
    start_s: npt.NDArray[np.float64]  # per request: when its load started, from the run's start
    hit_blocks: npt.NDArray[np.int64]
    speedup: float
    workers: int
    wall_s: float
    errors: int = 0  # requests whose load raised
    wrong_blocks: int = 0
    messages: list[str] = field(default_factory=list)  # the first few errors
    store_errors: int = 0  # requests whose store raised (served, not offloaded)
    store_messages: list[str] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)  # name -> when it ran (run's clock)
    # cluster clients: puts_rerouted, puts_short (fewer copies than replicas), puts_lost
    cluster_puts: dict[str, int] = field(default_factory=dict)

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
            "store_errors": self.store_errors,
            "store_messages": self.store_messages,
            "events": {k: round(v, 3) for k, v in self.events.items()},
            "cluster_puts": self.cluster_puts,
        }


def _p99_ms(values: npt.NDArray[np.float64]) -> float | None:
    ok = values[np.isfinite(values)]
    return round(float(np.quantile(ok, 0.99)) * 1e3, 3) if ok.size else None


def windows(
    result: LiveResult, at_s: float, width_s: float = 1.0, factor: float = 2.0
) -> dict[str, object]:
    """Load latency p99 per `width_s` window of load completion time (as a monitor sees
    them: a load stuck on the fault counts when it ends), windows aligned on `at_s` (window k
    covers [at_s + k w, at_s + (k + 1) w)), against the p99 of every load that ended before
    `at_s`. `back_s`: when the windows from k = 0 on are first back within
    `factor` times that (0.0: window 0 already is); `settled_s`: the end of the last window
    from k = 0 on that is not (a later spike counts too, which `over_after` lists).
    """
    end, load, lag = result.start_s + result.load_s, result.load_s, result.lag_s
    base = _p99_ms(load[end < at_s])
    rows: list[dict[str, object]] = []
    seen = end[np.isfinite(end)]  # a request whose load failed has no end
    first = int(np.floor((float(seen.min()) - at_s) / width_s)) if seen.size else 0
    last = int(np.floor((float(seen.max()) - at_s) / width_s)) if seen.size else -1
    back: float | None = None
    settled = 0.0
    over_after: list[int] = []
    for k in range(first, last + 1):
        inside = (end >= at_s + k * width_s) & (end < at_s + (k + 1) * width_s)
        p99 = _p99_ms(load[inside])
        rows.append({"k": k, "requests": int(inside.sum()), "load_p99_ms": p99,
                     "lag_p99_ms": _p99_ms(lag[inside])})  # fmt: skip
        if k < 0 or base is None or p99 is None:
            continue
        if p99 > factor * base:
            settled = (k + 1) * width_s
            if back is not None:
                over_after.append(k)
        elif back is None:
            back = k * width_s
    known = base is not None
    return {
        "at_s": round(at_s, 3),
        "width_s": width_s,
        "factor": factor,
        "before_p99_ms": base,
        "after_p99_ms": _p99_ms(load[end >= at_s]),
        "back_s": back if known else None,
        "settled_s": settled if known else None,
        "over_after": over_after,
        "windows": rows,
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
    events: Sequence[tuple[str, float, Callable[[], object]]] = (),
) -> LiveResult:
    """Replay `chains` against the store at `url` (module doc); each of `events` (name, replay
    second, call) runs once at that time, on a thread of its own.

    Raises:
        ConfigError: `speedup` or `workers` is not positive, the lists differ in length, or
            `url` is not a valid store URL.
    """
    if not speedup > 0 or workers < 1:
        raise ConfigError("a live replay needs speedup > 0 and at least one worker")
    if len(chains) != len(arrivals):
        raise ConfigError("one arrival time per request chain")
    n = len(chains)
    load = np.full(n, np.nan)
    lag = np.zeros(n)
    started = np.full(n, np.nan)
    hits = np.zeros(n, dtype=np.int64)
    lock = threading.Lock()
    counters = {"errors": 0, "wrong": 0, "store": 0}
    messages: list[str] = []
    store_messages: list[str] = []
    ran: dict[str, float] = {}
    failed: list[BaseException] = []
    stop = threading.Event()  # set on an exception: requests not yet started return at once
    local = threading.local()
    first = arrivals[0] if n else 0.0

    def client() -> Client:
        if not hasattr(local, "client"):
            try:
                local.client = connected.pop()
            except IndexError:  # connecting failed before the run: each request tries again
                local.client = Client.connect(url, namespace=namespace)
                clients.append(local.client)
        c: Client = local.client
        return c

    def one(i: int) -> None:
        due = start + (arrivals[i] - first) / speedup
        now = time.perf_counter()
        if (now < due and stop.wait(due - now)) or stop.is_set():
            return
        lag[i] = max(0.0, time.perf_counter() - due)
        keys = chains[i]
        try:
            c = client()
            t0 = time.perf_counter()
            started[i] = t0 - start
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
            if wrong:
                with lock:
                    counters["wrong"] += wrong
        except (KVOffloadError, OSError) as exc:
            with lock:
                counters["errors"] += 1
                if len(messages) < 5:
                    messages.append(f"request {i}: {type(exc).__name__}: {exc}")
            return
        rest = range(loaded, len(keys))
        try:
            if rest:
                c.put_many([(keys[j], payloads.fresh(keys[j])) for j in rest],
                           parents=[keys[j - 1] if j else None for j in rest])  # fmt: skip
        except (KVOffloadError, OSError) as exc:
            with lock:
                counters["store"] += 1
                if len(store_messages) < 5:
                    store_messages.append(f"request {i}: {type(exc).__name__}: {exc}")

    def fire(name: str, at: float, call: Callable[[], object]) -> None:
        if stop.wait(max(0.0, start + at - time.perf_counter())):
            return
        ran[name] = time.perf_counter() - start  # the instant it was asked for, before it acts
        try:
            call()
        except BaseException as exc:  # raised by the caller's thread once the run ends
            failed.append(exc)

    clients: list[Client] = []
    store: dict[str, int] = {}  # cluster clients' put counters, added up
    connected: list[Client] = []  # one client per worker, connected before the clock starts
    try:
        for _ in range(workers):
            connected.append(Client.connect(url, namespace=namespace))
    except ConfigError:  # the URL itself: no request could run
        for c in connected:
            c.close()
        raise
    except (KVOffloadError, OSError):
        pass  # each request connects (and counts the error) on its own
    clients += connected
    start = time.perf_counter()
    timers = [threading.Thread(target=fire, args=e, daemon=True) for e in events]
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        for t in timers:
            t.start()
        list(pool.map(one, range(n)))
        for t in timers:
            t.join()  # an event past the last request still runs (and its error is its own)
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        for c in clients:
            with contextlib.suppress(KVOffloadError, OSError):
                mine = c.stats().store.get("cluster")
                for name, value in mine.items() if isinstance(mine, dict) else ():
                    if name.startswith("puts_"):
                        store[name] = store.get(name, 0) + int(value)
            c.close()
    if failed:
        raise failed[0]
    return LiveResult(load, lag, started, hits, speedup, workers, time.perf_counter() - start,
                      counters["errors"], counters["wrong"], messages, counters["store"],
                      store_messages, ran, store)  # fmt: skip
