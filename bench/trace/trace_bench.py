"""`kvoffload bench trace`: replay a multi-turn workload through the store, across eviction
policies and capacities, next to vLLM's and LMCache's own caches on the same trace.

Every request looks up its block chain, loads (and verifies) the hit blocks, then stores the
blocks it had to compute, with parent keys. Capacities are fractions of the trace's working set
(its distinct blocks). DRAM-only runs hold that many blocks in DRAM; DRAM+SSD runs split the
same number of blocks 1:3 between DRAM and SSD. Peers replay the same chains in their own
environment (see `peers/peer_driver.py`); a peer that is not installed gives rows with no value
and a note. Hit counts depend on how many blocks fit, not on their bytes, so by default a block's
payload is scaled down (capacities scaled with it; `--full` stores real-size blocks instead),
and the TTFT model plugs in load times of real-size blocks measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress

from kvoffload.bench import common
from kvoffload.bench.cluster.faults import FAULTS, NetnsCluster
from kvoffload.bench.common import Row
from kvoffload.bench.peers import peer_driver
from kvoffload.bench.trace import ttft
from kvoffload.bench.trace.live import live_replay, windows
from kvoffload.bench.trace.model import (
    DEFAULT_PAYLOAD,
    PEERS,
    Config,
    Run,
    Workload,
    block_slot,
    plan,
    ssd_bytes,
)
from kvoffload.bench.trace.mooncake import read_trace, window
from kvoffload.bench.trace.replay import Payloads, ReplayResult, replay
from kvoffload.bench.trace.tables import (
    TraceResult,
    named_notes,
    optimum_details,
    result_notes,
    result_rows,
    run_details,
    ttft_rows,
    ttft_summary,
)
from kvoffload.bench.trace.workload import (
    PROFILES,
    ModelProfile,
    Trace,
    TraceShape,
    generate,
    write_jsonl,
)
from kvoffload.client_sdk import BlockKey, Client
from kvoffload.errors import ConfigError, InvalidArgumentError
from kvoffload.kvstore import PAGE, POLICIES, DramConfig
from kvoffload.wire.membership import redact_url

__all__ = ["HELP", "PEERS", "TraceResult", "Workload", "add_arguments", "run", "run_from_args"]

HELP = (
    "trace replay (generated multi-turn, our JSONL or Mooncake FAST'25 hash_ids traces): "
    "eviction policies x capacities against LRU and the offline optimum, vLLM and LMCache "
    "side by side"
)


def _local_url(config: Config, slot: int, scratch: Path | None) -> str:
    params = f"dram={config.dram_blocks * slot}&max_value={slot}&prefault=0&policy={config.system}"
    if not config.ssd:
        return f"local://?{params}"
    assert scratch is not None
    path = scratch / f"store-{config.system}-{config.percent}"
    admit = f"&admit={config.admit}" if config.admit else ""
    return f"local://{path}?{params}&ssd={ssd_bytes(config.ssd_blocks, slot)}{admit}"


# ------------------------------------------------------------------------------- running


def _replay_run(
    config: Config | None,
    url: str,
    work: Workload,
    payloads: Payloads,
    progress: Callable[[int], None],
) -> Run:
    with Client.connect(url, namespace=work.namespace) as client:
        result = replay(
            client,
            work.chains,
            work.prompt_tokens,
            payloads,
            block_tokens=work.block_tokens,
            count_ssd_hits=bool(config and config.ssd) or config is None,
            progress=progress,
        )
        store = client.stats().store
    if config is None:  # a store we did not configure: describe it from its own counters
        config = _describe(store, work, payloads.size)
    return _from_replay(config, result)


def _from_replay(config: Config, result: ReplayResult) -> Run:
    return Run(
        config,
        hit_blocks=result.hit_blocks,
        seconds=result.time_per_request_s,
        load_s=result.load_s,
        ssd_hits=result.ssd_hits,
        bytes_read=result.bytes_read,
        bytes_written=result.bytes_written,
        wall_s=result.wall_s,
        verified_blocks=result.verified_blocks,
        tier_runs=result.tier_runs or None,
    )


def _describe(store: dict[str, object], work: Workload, payload: int) -> Config:
    """A store we did not configure, from its own counters (whatever of them it reports)."""
    tiers = store.get("tiers", ())
    if not isinstance(tiers, (list, tuple)):
        tiers = ()
    sizes = [int(t.get("capacity_bytes", 0)) if isinstance(t, dict) else 0 for t in tiers]
    slot = block_slot(payload)
    dram = sizes[0] // slot if sizes else 0
    ssd = sizes[1] // (slot + PAGE) if len(sizes) > 1 else 0
    percent = round(100 * (dram + ssd) / max(1, work.working_set))
    return Config(str(store.get("policy", "store")), bool(ssd), percent, dram, ssd)


def _peer_work(work: Workload, directory: Path) -> Path:
    """The chains as arrays for the peer driver: distinct keys, per-request indices, tokens."""
    index: dict[BlockKey, int] = {}
    chain: list[int] = []
    offsets = [0]
    token_parts = []
    token_offsets = [0]
    bt = work.block_tokens
    for request, keys in zip(work.trace.requests, work.chains, strict=True):
        chain.extend(index.setdefault(k, len(index)) for k in keys)
        offsets.append(len(chain))
        token_parts.append(request.tokens[: len(keys) * bt])
        token_offsets.append(token_offsets[-1] + len(keys) * bt)
    path = directory / "peer-work.npz"
    np.savez(
        path,
        keys=np.frombuffer(b"".join(index), dtype=np.uint8).reshape(-1, 16),
        chain=np.asarray(chain, dtype=np.int64),
        offsets=np.asarray(offsets, dtype=np.int64),
        tokens=np.concatenate(token_parts) if token_parts else np.empty(0, np.uint32),
        token_offsets=np.asarray(token_offsets, dtype=np.int64),
    )
    return path


def _peer_runs(
    peer: str,
    python: str,
    configs: list[Config],
    work_file: Path,
    work: Workload,
    payload: int,
    scratch: Path,
    timeout_s: float,
) -> tuple[list[Run], dict[str, object]]:
    """Run one peer over its configurations in a subprocess; failures become notes."""
    out = scratch / f"peer-{peer}.json"
    cmd = [python, peer_driver.__file__, str(work_file), str(out),
           "--peer", peer, "--capacities", ",".join(str(c.dram_blocks) for c in configs),
           "--disk", ",".join(str(c.ssd_blocks) for c in configs),
           "--block-tokens", str(work.block_tokens), "--payload", str(payload),
           "--dir", str(scratch)]  # fmt: skip
    info: dict[str, object] = {"python": python}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        data = json.loads(out.read_text()) if out.exists() else {}
        if not data:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            data = {"error": f"peer driver exited {proc.returncode}: {' | '.join(tail)}"}
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        data = {"error": f"peer driver did not run: {exc}"}
    info.update(version=data.get("version"), error=data.get("error"), note=data.get("note"))
    runs = []
    by_capacity = {(r["capacity_blocks"], r["disk_blocks"]): r for r in data.get("runs", [])}
    for config in configs:
        raw = by_capacity.get((config.dram_blocks, config.ssd_blocks), {})
        error = str(raw.get("error") or data.get("error") or "no result")
        if "hit_blocks" not in raw:
            runs.append(Run(config, error=error.strip().splitlines()[-1]))
            continue
        hits = np.asarray(raw["hit_blocks"], dtype=np.int64)
        seconds = np.asarray(raw["seconds"], dtype=np.float64)
        runs.append(
            Run(config, hit_blocks=hits, seconds=seconds, load_s=None,
                bytes_read=int(hits.sum()) * payload,
                wall_s=float(seconds.sum()), verified_blocks=int(raw.get("verified_blocks", 0)))
        )  # fmt: skip
    return runs, info


def measure_load_costs(url_for: Callable[[bool], str | None], profile: ModelProfile,
                       block_tokens: int, blocks: int = 16,
                       parts: int = 1) -> ttft.LoadCosts:  # fmt: skip
    """Seconds per real-size block of a verified `get_many_into` of `blocks` blocks (how the
    vLLM connector loads a request), from DRAM and (when `url_for(True)` gives a store with an
    SSD tier) from the SSD after a reopen: the best of three batches (each SSD batch of keys
    of its own, as a second read would come from DRAM). With `parts` > 1 each block is that
    many values of a layer part's size (the connector's `layer_parts`), and a batch is
    `blocks` values of one part, as the connector reads a staging batch part by part (the
    same store room as the whole-block batches)."""
    size = profile.bytes_per_token * block_tokens // parts
    ns = profile.namespace(block_tokens, salt=f"load-cost-{parts}")
    payloads = Payloads(size, seed=1)
    values, made = blocks, blocks / parts  # a batch's values, and the blocks they make
    keys = [BlockKey(i.to_bytes(16, "little")) for i in range(1, values + 1)]
    bufs = [np.empty(size, dtype=np.uint8) for _ in keys]

    def timed_reads(client: Client, rounds: int) -> float:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            got = client.get_many_into(keys, bufs)
            best = min(best, (time.perf_counter() - t0) / made)
            for key, n, buf in zip(keys, got, bufs, strict=True):
                if n != size or not payloads.matches(key, buf):
                    raise ConfigError(f"calibration block {key.hex()} did not read back")
        return best

    dram_url = url_for(False)
    assert dram_url is not None
    with Client.connect(dram_url, namespace=ns) as client:
        for key in keys:
            client.put(key, payloads.of(key))
        dram_s = timed_reads(client, 3)
        for key in keys:
            client.delete(key)
    ssd_url = url_for(True)
    ssd_s = None
    if ssd_url is not None:
        # Each SSD round reads its own keys from a reopened store (DRAM cold), so every round
        # reads the disk; the best of three, as for DRAM, keeps one stall of a shared host out.
        rounds = [[BlockKey((r * values + i).to_bytes(16, "little")) for i in range(1, values + 1)]
                  for r in range(3)]  # fmt: skip
        with Client.connect(ssd_url, namespace=ns) as client:
            for key in (k for batch in rounds for k in batch):
                client.put(key, payloads.of(key), durable=True)
        for batch in rounds:
            keys[:] = batch
            with Client.connect(ssd_url, namespace=ns) as client:  # reopened: DRAM is cold
                cost = timed_reads(client, 1)
            ssd_s = cost if ssd_s is None else min(ssd_s, cost)
    return ttft.LoadCosts(dram_s, ssd_s)


@contextmanager
def _scratch(directory: str | None) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvoffload-bench-trace-", dir=directory))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _peer_python(peer: str, args: argparse.Namespace) -> str:
    package, env = PEERS[peer]
    return common.peer_python(package, getattr(args, f"{package}_python", None), env)


def _check(
    model: str,
    policies: Sequence[str],
    tiers: Sequence[str],
    peers: Sequence[str],
    gpus: Sequence[str],
    layer_parts: Sequence[int],
    percents: Sequence[int],
    ssd_percents: Sequence[int] | None,
) -> None:
    """Raise `ConfigError` for what `run` cannot replay (see there)."""
    if model not in PROFILES:
        raise ConfigError(f"unknown model profile {model!r}; choose one of {sorted(PROFILES)}")
    checks: list[tuple[Sequence[str], Collection[str], str]] = [
        (policies, POLICIES, "policy"),
        (tiers, ("dram", "ssd"), "tier"),
        (peers, PEERS, "peer"),
        (gpus, ttft.GPUS, "GPU profile"),
    ]
    for name, known, what in checks:
        bad = sorted(set(name) - set(known))
        if bad:
            raise ConfigError(f"unknown {what} {bad}; choose from {sorted(known)}")
    if not layer_parts or any(p < 1 for p in layer_parts):
        raise ConfigError("layer parts are positive integers")
    if not percents or any(not 0 < p <= 100 for p in [*percents, *(ssd_percents or ())]):
        raise ConfigError("capacities are percentages of the working set in (0, 100]")


def _peer_replay(
    peer: str,
    python: str,
    work: Workload,
    work_file: Path,
    size: int,
    scratch: Path,
    timeout_s: float,
    percents: Sequence[int],
    tiers: Sequence[str],
    ssd_percents: Sequence[int] | None,
) -> tuple[list[Run], dict[str, object]]:
    """One peer's runs over the capacities (vLLM's have no disk tier: rows with that error)."""
    working_set = work.working_set
    configs = plan(working_set, percents, [peer], tiers, ssd_percents)
    if peer.startswith("vllm"):
        configs = [c for c in configs if not c.ssd]
    runs, info = _peer_runs(peer, python, configs, work_file, work, size, scratch, timeout_s)
    if peer.startswith("vllm") and "ssd" in tiers:
        no_disk = "vLLM's CPU offloading manager has no disk tier here"
        ssd_plan = plan(working_set, percents, [peer], ["ssd"], ssd_percents)
        runs += [Run(c, error=no_disk) for c in ssd_plan]
    return runs, info


def _calibrate(url: str | None, profile: ModelProfile, block_tokens: int, tiers: Sequence[str],
               layer_parts: Sequence[int],
               scratch: Path) -> tuple[dict[int, ttft.LoadCosts], str]:  # fmt: skip
    """Load times of real-size blocks per layer-part count, from `url` or else a local store
    in `scratch`; and a note when `url` refused them and a local store was measured."""

    def url_for(ssd: bool, target: str | None = url) -> str | None:
        if target:
            return None if ssd else target
        real = block_slot(profile.bytes_per_token * block_tokens)
        base = f"dram={64 * real}&max_value={real}&prefault=0"
        if not ssd:
            return f"local://?{base}"
        if "ssd" not in tiers:
            return None
        return f"local://{scratch / 'calibration'}?{base}&ssd={ssd_bytes(64, real)}"

    calibration = ""
    every: dict[int, ttft.LoadCosts] = {}
    for parts in layer_parts:
        try:
            every[parts] = measure_load_costs(url_for, profile, block_tokens, parts=parts)
        except InvalidArgumentError as exc:  # e.g. the store's blocks are smaller than real
            every[parts] = measure_load_costs(lambda ssd: url_for(ssd, None), profile,
                                              block_tokens, parts=parts)  # fmt: skip
            calibration = f"load times measured on a local store: {url} refused them ({exc})"
    return every, calibration


def run(
    trace: Trace,
    *,
    model: str = "llama-3.1-8b",
    block_tokens: int = 16,
    percents: Sequence[int] = (10, 20, 30, 50, 70, 100),
    ssd_percents: Sequence[int] | None = None,
    policies: Sequence[str] = ("lru", "s3fifo", "prefix"),
    tiers: Sequence[str] = ("dram", "ssd"),
    peers: Sequence[str] = tuple(PEERS),
    peer_python: Callable[[str], str] = lambda peer: sys.executable,
    full: bool = False,
    payload: int = DEFAULT_PAYLOAD,
    url: str | None = None,
    directory: str | None = None,
    gpus: Sequence[str] = ("h100",),
    layer_parts: Sequence[int] = (1, 4),
    realistic: bool = True,
    admissions: Sequence[int] = (0,),
    score_window: tuple[float, float] | None = None,
    peer_timeout_s: float = 3600.0,
    console: Console | None = None,
) -> TraceResult:
    """Replay `trace` for each configuration and return rows plus details (see module doc).

    Raises:
        ConfigError: unknown model, policy, tier, peer or GPU profile; bad capacities.
    """
    _check(model, policies, tiers, peers, gpus, layer_parts, percents, ssd_percents)
    layer_parts = sorted({1, *layer_parts})  # whole blocks are always modelled
    named = bool(trace.block_tokens)  # the trace names its blocks (Mooncake): no token ids
    if named:
        block_tokens = trace.block_tokens
        skipped_peers, peers = list(peers), ()
    profile = PROFILES[model]
    salt = f"trace-{os.getpid()}-{time.time_ns()}" if url else ""
    work = Workload.build(trace, profile, block_tokens, salt)
    size = profile.bytes_per_token * block_tokens if full else payload
    payloads = Payloads(size)
    slot = block_slot(size)
    working_set = work.working_set
    result = TraceResult("trace")
    configs = [] if url else plan(working_set, percents, policies, tiers, ssd_percents, realistic,
                                  admissions)  # fmt: skip
    runs: list[Run] = []
    console = console or Console(stderr=True)
    with _scratch(directory) as scratch, Progress(console=console, transient=True) as bar:
        n = len(work.chains)
        task = bar.add_task("replay", total=n * max(1, len(configs)))
        todo: list[Config | None] = list(configs) if configs else [None]
        for config in todo:
            bar.update(task, description=f"replay {config.case if config else url}")
            target = url if config is None else _local_url(config, slot, scratch)
            assert target is not None
            runs.append(_replay_run(config, target, work, payloads, lambda k: bar.advance(task, k)))
            if config is not None and config.ssd:
                shutil.rmtree(
                    scratch / f"store-{config.system}-{config.percent}", ignore_errors=True
                )
        peer_info: dict[str, object] = {}
        if not url and peers:
            work_file = _peer_work(work, scratch)
            for peer in peers:
                bar.update(task, description=f"peer {peer}")
                peer_runs, peer_info[peer] = _peer_replay(
                    peer, peer_python(peer), work, work_file, size, scratch, peer_timeout_s,
                    percents, tiers, ssd_percents,
                )  # fmt: skip
                runs += peer_runs
        bar.update(task, description="measuring load times of real-size blocks")
        every, calibration = _calibrate(url, profile, block_tokens, tiers, layer_parts, scratch)
        costs = every[1]
    ideal = work.ideal_hit_tokens()
    prompt_total = int(work.prompt_tokens.sum())
    summary = trace.summary()
    own = policies if not url else [r.config.system for r in runs]
    result.rows = result_rows(runs, own, [] if url else peers, work)
    none = np.zeros_like(work.prompt_tokens)
    no_cache = {
        name: ttft_summary(ttft.prefill_seconds(profile, ttft.GPUS[name], work.prompt_tokens, none))
        for name in gpus
    }
    result.details = {
        "trace": {"source": trace.source, "shape": trace.shape, **summary},
        "model": {"name": profile.name, "id": profile.model,
                  "bytes_per_token": profile.bytes_per_token, "tp_size": profile.tp_size},
        "block_tokens": block_tokens,
        "block_bytes_real": profile.bytes_per_token * block_tokens,
        "payload_bytes": size,
        "scaled": not full,
        "url": redact_url(url) if url else url,
        "working_set_blocks": working_set,
        "ideal_hit_tokens": ideal,
        "ideal_hit_ratio": round(ideal / max(1, prompt_total), 5),
        "belady_hit_tokens": {
            str(p): work.belady_hit_tokens(max(2, round(working_set * p / 100)))
            for p in sorted({*percents, *(ssd_percents or ())})
        },
        "load_costs": _costs_ms(costs),
        "layer_parts": {str(p): _costs_ms(c) for p, c in every.items() if p > 1},
        "gpus": {g: vars(ttft.GPUS[g]) for g in gpus},
        "ttft_no_cache": no_cache,
        "peers": peer_info,
        "runs": [run_details(r, work, every, gpus) for r in runs],
    }  # fmt: skip
    details_runs = result.details["runs"]
    assert isinstance(details_runs, list)
    result.rows += ttft_rows(details_runs, no_cache, profile.name, DramConfig().policy)
    result.notes += result_notes(work, size, full, costs, url, peer_info)
    if named:
        result.details["optimum"] = optimum_details(work, percents, runs, score_window)
        result.notes += named_notes(work, size, skipped_peers)
    if calibration:
        result.notes.append(calibration)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("trace")
    src.add_argument("--trace", metavar="JSONL",
                     help="replay this trace instead of generating: our JSONL, or a Mooncake "
                     "FAST'25 trace (timestamp, input_length, output_length, hash_ids; "
                     "detected from its fields, .xz read too)")  # fmt: skip
    src.add_argument(
        "--window",
        metavar="START:END",
        help="replay only the requests arriving in [START, END) seconds",
    )
    src.add_argument("--sessions", type=int, default=200, help="generated sessions")
    src.add_argument("--seed", type=int, default=0, help="generator seed")
    src.add_argument("--docqa", type=float, default=0.2, help="share of document-QA sessions")
    src.add_argument("--arrival-rate", type=float, default=1.0, help="sessions per second")
    src.add_argument("--think-time", type=float, default=60.0, help="mean seconds between turns")
    src.add_argument("--write-trace", metavar="JSONL", help="also write the trace used")
    store = parser.add_argument_group("store")
    store.add_argument("--model", default="llama-3.1-8b", choices=sorted(PROFILES))
    store.add_argument("--block-tokens", type=int, default=16)
    store.add_argument("--capacities", default="10,20,30,50,70,100",
                       help="percent of the working set, comma-separated")  # fmt: skip
    store.add_argument("--ssd-capacities", help="for DRAM+SSD runs (default: --capacities)")
    store.add_argument(
        "--policies",
        default="lru,s3fifo,prefix",
        help=f"eviction policies, of {', '.join(sorted(POLICIES))}",
    )
    store.add_argument(
        "--admission",
        default="0",
        help="DRAM+SSD runs once per SSD admission_min_uses in this list (0: the engine default)",
    )
    store.add_argument(
        "--score-window",
        metavar="START:END",
        help="trace naming its blocks: also count the optimum table's hits over "
        "the requests arriving in [START, END) s only (the whole trace replayed)",
    )
    store.add_argument("--tiers", default="dram,ssd", help="dram (DRAM only), ssd (DRAM+SSD)")
    store.add_argument("--full", action="store_true", help="store real-size blocks (slow)")
    store.add_argument("--payload", type=int, default=DEFAULT_PAYLOAD,
                       help="bytes per scaled block")  # fmt: skip
    store.add_argument("--url", help="replay once against this store (any Client.connect URL)")
    store.add_argument(
        "--live",
        metavar="URL",
        help="live replay against this running store at the trace's arrival "
        "times divided by --speedup: load latency p50/p99, errors, wrong blocks; "
        "'cluster': start etcd and --nodes daemons in network namespaces (root) and replay "
        "through cluster+etcd://",
    )
    live = parser.add_argument_group("live replay against a cluster (--live cluster)")
    live.add_argument("--nodes", type=int, default=3, help="daemons, one namespace each")
    live.add_argument("--node-dram", default="64MiB", help="DRAM tier of each daemon")
    live.add_argument("--replicas", type=int, default=2, help="the cluster URL's replicas")
    live.add_argument("--timeout", type=float, default=1.0,
                      help="the cluster URL's timeout: seconds per call to a node")  # fmt: skip
    live.add_argument("--lease-ttl", type=int, default=3, help="the nodes' etcd lease TTL (s)")
    live.add_argument("--fault", choices=FAULTS,
                      help="kill: SIGKILL a node; blackhole: take its link down inside its "
                      "namespace (packets vanish, no reset)")  # fmt: skip
    live.add_argument("--fault-at", type=float, default=10.0,
                      help="seconds into the replay (wall clock) of the fault")  # fmt: skip
    live.add_argument("--fault-node", type=int, default=0, help="which node (0-based)")
    store.add_argument(
        "--speedup",
        type=float,
        default=10.0,
        help="live replay: arrival times compressed by this factor",
    )
    store.add_argument(
        "--workers",
        type=int,
        default=8,
        help="live replay: requests in flight at most (threads, a client each)",
    )
    store.add_argument("--dir", help="scratch directory for SSD stores (O_DIRECT capable)")
    store.add_argument("--gpus", default="h100", help=f"TTFT profiles: {', '.join(ttft.GPUS)}")
    store.add_argument("--layer-parts", default="1,4",
                       help="model the connector with the KV in this many layer parts (loads "
                       "overlap compute; 1 = whole blocks, always modelled)")  # fmt: skip
    store.add_argument(
        "--realistic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run DRAM 10%% + SSD 100%% of the working set (with tier ssd)",
    )
    peers = parser.add_argument_group("peers")
    peers.add_argument("--peers", default=",".join(PEERS), help="peers to run ('' for none)")
    peers.add_argument("--vllm-python", help="Python with vllm (env KVOFFLOAD_VLLM_PYTHON)")
    peers.add_argument("--lmcache-python",
                       help="Python with lmcache (env KVOFFLOAD_LMCACHE_PYTHON)")  # fmt: skip


def _costs_ms(costs: ttft.LoadCosts) -> dict[str, float | None]:
    return {"dram_ms": round(costs.dram_s * 1e3, 4),
            "ssd_ms": None if costs.ssd_s is None else round(costs.ssd_s * 1e3, 4)}  # fmt: skip


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _span(text: str, flag: str) -> tuple[float, float]:
    try:
        start, end = (float(t) for t in text.split(":"))
    except ValueError:
        raise ConfigError(f"{flag} takes START:END seconds, not {text!r}") from None
    if not start < end:
        raise ConfigError(f"{flag} needs START < END, got {text!r}")
    return start, end


def load_trace(args: argparse.Namespace) -> Trace:
    if args.trace:
        trace = read_trace(args.trace, seed=args.seed)
        if getattr(args, "window", None):
            trace = window(trace, *_span(args.window, "--window"))
        return trace
    shape = TraceShape(sessions=args.sessions, docqa_fraction=args.docqa,
                       arrival_rate=args.arrival_rate, think_time_s=args.think_time)  # fmt: skip
    return generate(shape, seed=args.seed)


def _ms(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def run_live(
    trace: Trace,
    url: str,
    *,
    model: str = "llama-3.1-8b",
    block_tokens: int = 16,
    payload: int = DEFAULT_PAYLOAD,
    speedup: float = 10.0,
    workers: int = 8,
    fault: tuple[str, float, Callable[[], object]] | None = None,
) -> TraceResult:
    """`live_replay` of `trace` against the store at `url`, as rows and details; `fault`
    (name, replay second, call) runs mid-run, and the 1 s windows are cut around it.

    Raises:
        ConfigError: unknown model, bad speedup or workers.
    """
    if model not in PROFILES:
        raise ConfigError(f"unknown model profile {model!r}; choose one of {sorted(PROFILES)}")
    profile = PROFILES[model]
    salt = f"live-{os.getpid()}-{time.time_ns()}"  # a shared store: never last run's blocks
    work = Workload.build(trace, profile, trace.block_tokens or block_tokens, salt)
    arrivals = [r.arrival for r in trace.requests]
    events = [fault] if fault else []
    live = live_replay(url, work.namespace, work.chains, arrivals, Payloads(payload),
                       speedup=speedup, workers=workers, events=events)  # fmt: skip
    summary = live.summary()
    result = TraceResult("trace")
    result.rows = [
        Row("live/load_p50", _ms(summary["load_p50_ms"]), "ms"),
        Row("live/load_p99", _ms(summary["load_p99_ms"]), "ms"),
        Row("live/errors", float(live.errors), "count"),
        Row("live/wrong_blocks", float(live.wrong_blocks), "count"),
        Row("live/store_errors", float(live.store_errors), "count"),
    ]
    if fault is not None and fault[0] in live.events:
        report = windows(live, live.events[fault[0]])
        summary["windows"] = report
        result.rows += [
            Row("live/before_p99", _ms(report["before_p99_ms"]), "ms"),
            Row("live/after_p99", _ms(report["after_p99_ms"]), "ms"),
            Row("live/recovery", _ms(report["settled_s"]), "s", "goal", 2.0,
                note="from the fault to the end of the last 1 s window (by completion) whose "
                "load p99 is above 2x the p99 before the fault, later spikes included: "
                f"windows {report['over_after']} after the first one back within 2x, at "
                f"{report['back_s']} s"),
        ]  # fmt: skip
    span = (arrivals[-1] - arrivals[0]) if arrivals else 0.0
    result.details = {"trace": {"source": trace.source, **trace.summary()}, "live": summary,
                      "url": redact_url(url),
                      "block_tokens": work.block_tokens, "payload_bytes": payload,
                      "block_bytes_real": profile.bytes_per_token * work.block_tokens}  # fmt: skip
    real = profile.bytes_per_token * work.block_tokens
    result.notes = [
        f"live replay of {len(arrivals):,} requests spanning {span:,.1f} s of the trace in "
        f"{live.wall_s:,.1f} s: arrival times compressed {speedup:g}x, {workers} workers",
        f"each block stored as {payload:,} B standing for {real:,} B of {profile.name} KV "
        f"(scaled 1:{real // payload:,})",
        "load latency: lookup + one get_many_into of the hit blocks, each checked bit for bit",
        "errors: requests whose load raised; store_errors: requests whose put_many raised "
        "(served, blocks not offloaded)",
    ]
    return result


def _live_cluster(trace: Trace, args: argparse.Namespace) -> TraceResult:
    """The live replay through `cluster+etcd://` to a fresh cluster in network namespaces,
    with `--fault` mid-run; everything removed at the end (SIGTERM ends it like Ctrl-C)."""
    # Checked before anything starts: a bad value must not cost a cluster's start.
    if args.nodes < 1 or not 1 <= args.replicas <= 16:
        raise ConfigError("--nodes must be at least 1 and --replicas 1..16")
    if not 0 < args.timeout <= 3600 or not 2 <= args.lease_ttl <= 3600:
        raise ConfigError("--timeout must be 0..3600 s (not 0) and --lease-ttl 2..3600 s")
    if args.fault and not 0 <= args.fault_node < args.nodes:
        raise ConfigError(f"--fault-node must be 0..{args.nodes - 1}")

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        with NetnsCluster(args.nodes, args.node_dram, args.lease_ttl) as cluster:
            # The replay's keys are chained block keys, named by their content: puts need one
            # live node, not every member (a lost node's share goes to the next one).
            url = cluster.url(args.replicas, args.timeout, immutable=True)
            fault = None
            if args.fault:
                fault = (args.fault, args.fault_at,
                         functools.partial(cluster.fault, args.fault, args.fault_node))  # fmt: skip
            result = run_live(trace, url, model=args.model, block_tokens=args.block_tokens,
                              payload=args.payload, speedup=args.speedup, workers=args.workers,
                              fault=fault)  # fmt: skip
            result.details["cluster"] = cluster.describe()
    finally:
        signal.signal(signal.SIGTERM, previous)
    result.notes.append(
        f"{args.nodes} daemons (--dram {args.node_dram}, no SSD), one network namespace each, "
        f"etcd membership (lease {args.lease_ttl} s), replicas={args.replicas}, "
        f"timeout={args.timeout:g} s, immutable=1 (content-named keys: a put needs one live "
        "node, not every member)"
        + (f"; {args.fault} of node {args.fault_node} at {args.fault_at:g} s" if args.fault else "")
    )
    return result


def run_from_args(args: argparse.Namespace) -> TraceResult:
    trace = load_trace(args)
    if args.live == "cluster":
        return _live_cluster(trace, args)
    if args.fault:
        raise ConfigError("--fault needs --live cluster")
    if args.live:
        return run_live(
            trace,
            args.live,
            model=args.model,
            block_tokens=args.block_tokens,
            payload=args.payload,
            speedup=args.speedup,
            workers=args.workers,
        )
    if args.write_trace:
        write_jsonl(trace, args.write_trace)
    try:
        percents = [int(p) for p in _csv(args.capacities)]
        ssd_percents = [int(p) for p in _csv(args.ssd_capacities)] if args.ssd_capacities else None
        layer_parts = [int(p) for p in _csv(args.layer_parts)]
        admissions = [int(p) for p in _csv(args.admission)]
    except ValueError:
        raise ConfigError(
            "--capacities, --ssd-capacities, --layer-parts, --admission take integers"
        ) from None
    if not admissions or any(a < 0 for a in admissions):
        raise ConfigError("--admission takes non-negative integers")
    score = _span(args.score_window, "--score-window") if args.score_window else None
    return run(
        trace,
        model=args.model,
        block_tokens=args.block_tokens,
        percents=percents,
        ssd_percents=ssd_percents,
        policies=_csv(args.policies),
        tiers=_csv(args.tiers),
        peers=_csv(args.peers),
        peer_python=lambda peer: _peer_python(peer, args),
        full=args.full,
        payload=args.payload,
        url=args.url,
        directory=args.dir,
        gpus=_csv(args.gpus),
        layer_parts=layer_parts,
        realistic=args.realistic,
        admissions=admissions,
        score_window=score,
    )
