"""`kvoffload bench trace`: replay a multi-turn workload through the store, across eviction
policies and capacities, next to vLLM's and LMCache's own caches on the same trace.

Every request looks up its block chain, loads (and verifies) the hit blocks, then stores the
blocks it had to compute, with parent keys. Capacities are fractions of the trace's working set
(its distinct blocks). DRAM-only runs hold that many blocks in DRAM; DRAM+SSD runs split the
same number of blocks 1:3 between DRAM and SSD. Peers replay the same chains in their own
environment (see `peer_driver.py`); a peer that is not installed gives rows with no value and a
note. Hit counts depend on how many blocks fit, not on their bytes, so by default a block's
payload is scaled down (capacities scaled with it; `--full` stores real-size blocks instead),
and the TTFT model plugs in load times of real-size blocks measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvoffload.bench import common, ttft
from kvoffload.bench.common import BenchResult, Row
from kvoffload.bench.replay import Payloads, ReplayResult, replay
from kvoffload.bench.workload import (
    PROFILES,
    ModelProfile,
    Trace,
    TraceShape,
    chain_keys,
    generate,
    read_jsonl,
    write_jsonl,
)
from kvoffload.client_sdk import BlockKey, Client, Namespace
from kvoffload.errors import ConfigError, InvalidArgumentError
from kvoffload.kvstore import POLICIES
from kvoffload.kvstore.config import PAGE

__all__ = ["HELP", "PEERS", "TraceResult", "Workload", "add_arguments", "run", "run_from_args"]

HELP = "multi-turn trace replay: eviction policies x capacities, vLLM and LMCache side by side"

# Peer name -> (package, environment variable naming the Python that has it).
PEERS: dict[str, tuple[str, str]] = {
    "vllm_lru": ("vllm", "KVOFFLOAD_VLLM_PYTHON"),
    "vllm_arc": ("vllm", "KVOFFLOAD_VLLM_PYTHON"),
    "lmcache": ("lmcache", "KVOFFLOAD_LMCACHE_PYTHON"),
}
SSD_SHARE = 0.75  # of a DRAM+SSD capacity, the SSD's part
DEFAULT_PAYLOAD = 3968  # + the 96-byte block header = one 4 KiB slot
CDF_POINTS = 101  # quantiles kept per run for latency CDFs


@dataclass
class Workload:
    """A trace made concrete for one model and block size: chains of block keys."""

    trace: Trace
    profile: ModelProfile
    namespace: Namespace
    chains: list[list[BlockKey]]
    prompt_tokens: npt.NDArray[np.int64]

    @classmethod
    def build(
        cls, trace: Trace, profile: ModelProfile, block_tokens: int, salt: str = ""
    ) -> Workload:
        namespace = profile.namespace(block_tokens, salt)
        prompts = np.array([r.prompt_tokens for r in trace.requests], dtype=np.int64)
        return cls(trace, profile, namespace, chain_keys(trace.requests, namespace), prompts)

    @property
    def block_tokens(self) -> int:
        return self.namespace.block_tokens

    @property
    def working_set(self) -> int:
        """Distinct blocks in the trace: what an unbounded store ends up holding."""
        return len({key for chain in self.chains for key in chain})

    def belady_hit_tokens(self, capacity: int) -> int:
        """Hit tokens of the offline Belady rule at `capacity` blocks: evict the block whose
        next use is farthest away (deepest first among equals), under the replay's rules (a
        request stores every block after its hit). A clairvoyant reference for the headroom
        an online policy could reach, not a policy."""
        never = len(self.chains)
        next_use: list[list[int]] = [[] for _ in self.chains]
        last: dict[BlockKey, int] = {}
        for i in range(len(self.chains) - 1, -1, -1):
            next_use[i] = [last.get(k, never) for k in self.chains[i]]
            for k in self.chains[i]:
                last[k] = i
        due: dict[BlockKey, int] = {}  # stored block -> index of its next use
        heap: list[tuple[int, int, BlockKey]] = []  # (-next use, -depth, key), lazily valid
        hits = 0
        for i, chain in enumerate(self.chains):
            hit = 0
            for key in chain:
                if key not in due:
                    break
                hit += 1
            hits += hit
            for j, key in enumerate(chain):
                if key not in due:
                    while len(due) >= capacity:
                        when, _, victim = heapq.heappop(heap)
                        if due.get(victim) == -when:
                            del due[victim]
                due[key] = next_use[i][j]
                heapq.heappush(heap, (-next_use[i][j], -j, key))
        return hits * self.block_tokens

    def ideal_hit_tokens(self) -> int:
        """Hit tokens with unbounded capacity: every block seen before is a hit."""
        seen: set[BlockKey] = set()
        hits = 0
        for chain in self.chains:
            for key in chain:
                if key not in seen:
                    break
                hits += 1
            seen.update(chain)
        return hits * self.block_tokens


@dataclass(frozen=True)
class Config:
    """One store configuration of the sweep."""

    system: str  # a kvoffload policy ("lru", "prefix", ...) or a peer ("vllm_arc", ...)
    ssd: bool
    percent: int
    dram_blocks: int
    ssd_blocks: int = 0

    @property
    def label(self) -> str:
        return f"{self.system}+ssd" if self.ssd else self.system

    @property
    def case(self) -> str:
        return f"hit_tokens/{self.label}/{self.percent}%"


@dataclass
class Run:
    config: Config
    hit_blocks: npt.NDArray[np.int64] | None = None
    seconds: npt.NDArray[np.float64] | None = None  # per request (load + store)
    load_s: npt.NDArray[np.float64] | None = None
    ssd_hits: npt.NDArray[np.int64] | None = None
    bytes_read: int = 0
    bytes_written: int = 0
    wall_s: float = 0.0
    verified_blocks: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.hit_blocks is not None


@dataclass
class TraceResult(BenchResult):
    """The bench's rows plus the tables printed next to them."""

    details: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        out = super().as_dict()
        out["details"] = self.details
        return out

    def print(self, console: Console | None = None) -> None:
        console = console or Console()
        _print_tables(self.details, console)
        super().print(console)


# ------------------------------------------------------------------------------- planning


@functools.cache
def _header_bytes() -> int:
    """What the SDK adds to each stored value (its block header), read from a store's own
    counters so the bench needs no private knowledge of the format."""
    with Client.connect("local://?dram=1MiB&prefault=0") as client:
        client.put(bytes(16), b"x")
        tiers = client.stats().store["tiers"]
        assert isinstance(tiers, (list, tuple))
        return int(tiers[0]["stored_bytes"]) - 1


def _slot(payload: int) -> int:
    """The DRAM slot of one stored block (payload + SDK header, rounded to pages)."""
    return -(-(payload + _header_bytes()) // PAGE) * PAGE


def _ssd_bytes(blocks: int, slot: int) -> int:
    """SSD capacity holding `blocks` blocks: the tier adds a header page per slot."""
    return blocks * (slot + PAGE)


def plan(
    working_set: int,
    percents: Sequence[int],
    systems: Sequence[str],
    tiers: Sequence[str],
    ssd_percents: Sequence[int] | None = None,
) -> list[Config]:
    configs = []
    for tier in tiers:
        for percent in ssd_percents if tier == "ssd" and ssd_percents is not None else percents:
            total = max(2, round(working_set * percent / 100))
            for system in systems:
                if tier == "ssd":
                    dram = max(1, round(total * (1 - SSD_SHARE)))
                    configs.append(Config(system, True, percent, dram, total - dram))
                else:
                    configs.append(Config(system, False, percent, total))
    return configs


def _local_url(config: Config, slot: int, scratch: Path | None) -> str:
    params = f"dram={config.dram_blocks * slot}&max_value={slot}&prefault=0&policy={config.system}"
    if not config.ssd:
        return f"local://?{params}"
    assert scratch is not None
    path = scratch / f"store-{config.system}-{config.percent}"
    return f"local://{path}?{params}&ssd={_ssd_bytes(config.ssd_blocks, slot)}"


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
    )


def _describe(store: dict[str, object], work: Workload, payload: int) -> Config:
    """A store we did not configure, from its own counters (whatever of them it reports)."""
    tiers = store.get("tiers", ())
    if not isinstance(tiers, (list, tuple)):
        tiers = ()
    sizes = [int(t.get("capacity_bytes", 0)) if isinstance(t, dict) else 0 for t in tiers]
    slot = _slot(payload)
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
    cmd = [python, str(Path(__file__).with_name("peer_driver.py")), str(work_file), str(out),
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
                       block_tokens: int, blocks: int = 16) -> ttft.LoadCosts:  # fmt: skip
    """Median seconds of a verified `get_into` of one real-size block, from DRAM and (when
    `url_for(True)` gives a store with an SSD tier) from the SSD after a reopen."""
    size = profile.bytes_per_token * block_tokens
    ns = profile.namespace(block_tokens, salt="load-cost")
    payloads = Payloads(size, seed=1)
    keys = [BlockKey(i.to_bytes(16, "little")) for i in range(1, blocks + 1)]
    buf = np.empty(size, dtype=np.uint8)

    def timed_reads(client: Client) -> float:
        samples = []
        for key in keys:
            t0 = time.perf_counter()
            got = client.get_into(key, buf)
            samples.append(time.perf_counter() - t0)
            if got != size or not payloads.matches(key, buf):
                raise ConfigError(f"calibration block {key.hex()} did not read back")
        return float(np.median(samples))

    dram_url = url_for(False)
    assert dram_url is not None
    with Client.connect(dram_url, namespace=ns) as client:
        for key in keys:
            client.put(key, payloads.of(key))
        dram_s = timed_reads(client)
        for key in keys:
            client.delete(key)
    ssd_url = url_for(True)
    ssd_s = None
    if ssd_url is not None:
        with Client.connect(ssd_url, namespace=ns) as client:
            for key in keys:
                client.put(key, payloads.of(key), durable=True)
        with Client.connect(ssd_url, namespace=ns) as client:  # reopened: DRAM is cold
            ssd_s = timed_reads(client)
    return ttft.LoadCosts(dram_s, ssd_s)


# ------------------------------------------------------------------------------- results


def _quantiles(values: npt.NDArray[np.float64]) -> list[float]:
    return [round(float(v), 6) for v in np.quantile(values, np.linspace(0, 1, CDF_POINTS))]


def _ttft_summary(seconds: npt.NDArray[np.float64]) -> dict[str, object]:
    ms = seconds * 1e3
    return {"mean_ms": round(float(ms.mean()), 3), "p50_ms": round(float(np.median(ms)), 3),
            "p90_ms": round(float(np.quantile(ms, 0.9)), 3), "cdf_ms": _quantiles(ms)}  # fmt: skip


def _run_details(run: Run, work: Workload, costs: ttft.LoadCosts | None,
                 gpus: Sequence[str]) -> dict[str, object]:  # fmt: skip
    c = run.config
    out: dict[str, object] = {
        "system": c.system, "tier": "dram+ssd" if c.ssd else "dram", "percent": c.percent,
        "dram_blocks": c.dram_blocks, "ssd_blocks": c.ssd_blocks, "error": run.error,
    }  # fmt: skip
    if not run.ok or run.hit_blocks is None or run.seconds is None:
        return out
    hit_tokens = run.hit_blocks * work.block_tokens
    prompt_total = int(work.prompt_tokens.sum())
    out.update(
        hit_tokens=int(hit_tokens.sum()),
        hit_ratio=round(float(hit_tokens.sum()) / max(1, prompt_total), 5),
        bytes_read=run.bytes_read,
        bytes_written=run.bytes_written,
        wall_s=round(run.wall_s, 3),
        ms_per_request=round(1e3 * float(run.seconds.mean()), 4),
        verified_blocks=run.verified_blocks,
        request_ms_cdf=_quantiles(run.seconds * 1e3),
    )
    if run.load_s is not None:
        out["load_ms_cdf"] = _quantiles(run.load_s * 1e3)
    if costs is not None and c.system in POLICIES:
        ssd_hits = run.ssd_hits if run.ssd_hits is not None else np.zeros_like(run.hit_blocks)
        model: dict[str, object] = {}
        for name in gpus:
            t = ttft.ttft_seconds(work.profile, ttft.GPUS[name], work.prompt_tokens,
                                  run.hit_blocks, ssd_hits, work.block_tokens, costs)  # fmt: skip
            model[name] = _ttft_summary(t)
        out["ttft_model"] = model
        out["ssd_hit_blocks"] = int(ssd_hits.sum())
    return out


def _rows(
    runs: list[Run], policies: Sequence[str], peers: Sequence[str], work: Workload
) -> list[Row]:
    """`hit_tokens/<policy>[+ssd]/<pct>%` against lru (same tier) and each peer that was asked
    for (vLLM's LRU and ARC, LMCache)."""
    by_key = {(r.config.system, r.config.ssd, r.config.percent): r for r in runs}
    rows = []
    for run in runs:
        c = run.config
        if c.system not in policies or run.hit_blocks is None:
            continue
        value = float(run.hit_blocks.sum() * work.block_tokens)
        for ref in ("lru", *peers):
            if ref == c.system:
                continue
            other = by_key.get((ref, c.ssd, c.percent))
            if other is None and ref in POLICIES:
                continue  # our own policy, not part of this sweep
            if other is None:
                note = "no disk tier driven for this peer" if c.ssd else "peer not run"
                rows.append(Row(c.case, value, "tokens", ref, None, note=note))
            elif other.hit_blocks is None:
                rows.append(Row(c.case, value, "tokens", ref, None, note=other.error))
            else:
                ref_value = float(other.hit_blocks.sum() * work.block_tokens)
                rows.append(Row(c.case, value, "tokens", ref, ref_value))
    return rows


def _print_tables(details: dict[str, object], console: Console) -> None:
    trace = details.get("trace", {})
    runs = details.get("runs", [])
    assert isinstance(trace, dict) and isinstance(runs, list)
    console.print(
        f"[bold]trace[/] {trace.get('source')}: {trace.get('requests', 0):,.0f} requests, "
        f"{trace.get('conversations', 0):,.0f} conversations, mean prompt "
        f"{trace.get('prompt_tokens_mean', 0):,.0f} tokens; working set "
        f"{details.get('working_set_blocks', 0):,} blocks of {details.get('block_tokens')} "
        f"tokens; ideal hit ratio {details.get('ideal_hit_ratio', 0):.3f}"
    )
    systems = list(dict.fromkeys(f"{r['system']}{'+ssd' if r['tier'] != 'dram' else ''}"
                                 for r in runs))  # fmt: skip
    table = Table(title="hit ratio (and ms per request) by capacity, % of the working set")
    table.add_column("capacity", justify="right")
    for s in systems:
        table.add_column(s, justify="right")
    belady = details.get("belady_hit_tokens", {})
    trace_tokens = float(trace.get("prompt_tokens_total", 0)) or 1.0
    assert isinstance(belady, dict)
    table.add_column("belady (offline)", justify="right")
    for percent in sorted({r["percent"] for r in runs}):
        cells = []
        for s in systems:
            match = [r for r in runs if r["percent"] == percent and
                     f"{r['system']}{'+ssd' if r['tier'] != 'dram' else ''}" == s]  # fmt: skip
            if not match:
                cells.append("")
            elif "hit_ratio" not in match[0]:
                cells.append("n/a")
            else:
                cells.append(f"{match[0]['hit_ratio']:.3f} ({match[0]['ms_per_request']:.2f})")
        ref = belady.get(str(percent))
        cells.append("" if ref is None else f"{ref / trace_tokens:.3f}")
        table.add_row(f"{percent}%", *cells)
    console.print(table)
    ttft_rows = [r for r in runs if "ttft_model" in r]
    base = details.get("ttft_no_cache", {})
    if ttft_rows and isinstance(base, dict):
        gpu = next(iter(base))
        t = Table(title=f"TTFT (model, {ttft.GPUS[gpu].name}; see notes): mean / p90 ms")
        t.add_column("run")
        t.add_column("mean", justify="right")
        t.add_column("p90", justify="right")
        t.add_row("no store", f"{base[gpu]['mean_ms']:.1f}", f"{base[gpu]['p90_ms']:.1f}")
        for r in ttft_rows:
            m = r["ttft_model"][gpu]
            label = f"{r['system']}{'+ssd' if r['tier'] != 'dram' else ''} @ {r['percent']}%"
            t.add_row(label, f"{m['mean_ms']:.1f}", f"{m['p90_ms']:.1f}")
        console.print(t)


# ------------------------------------------------------------------------------- entry


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
    peer_timeout_s: float = 3600.0,
    console: Console | None = None,
) -> TraceResult:
    """Replay `trace` for each configuration and return rows plus details (see module doc).

    Raises:
        ConfigError: unknown model, policy, tier, peer or GPU profile; bad capacities.
    """
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
    if not percents or any(not 0 < p <= 100 for p in [*percents, *(ssd_percents or ())]):
        raise ConfigError("capacities are percentages of the working set in (0, 100]")
    profile = PROFILES[model]
    salt = f"trace-{os.getpid()}-{time.time_ns()}" if url else ""
    work = Workload.build(trace, profile, block_tokens, salt)
    size = profile.bytes_per_token * block_tokens if full else payload
    payloads = Payloads(size)
    slot = _slot(size)
    working_set = work.working_set
    result = TraceResult("trace")
    configs = [] if url else plan(working_set, percents, policies, tiers, ssd_percents)
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
                peer_configs = plan(working_set, percents, [peer], tiers, ssd_percents)
                if peer.startswith("vllm"):
                    peer_configs = [c for c in peer_configs if not c.ssd]
                peer_runs, info = _peer_runs(peer, peer_python(peer), peer_configs, work_file,
                                             work, size, scratch, peer_timeout_s)  # fmt: skip
                runs += peer_runs
                peer_info[peer] = info
                if peer.startswith("vllm") and "ssd" in tiers:
                    no_disk = "vLLM's CPU offloading manager has no disk tier here"
                    ssd_plan = plan(working_set, percents, [peer], ["ssd"], ssd_percents)
                    runs += [Run(c, error=no_disk) for c in ssd_plan]
        bar.update(task, description="measuring load times of real-size blocks")

        def url_for(ssd: bool, target: str | None = url) -> str | None:
            if target:
                return None if ssd else target
            real = _slot(profile.bytes_per_token * block_tokens)
            base = f"dram={64 * real}&max_value={real}&prefault=0"
            if not ssd:
                return f"local://?{base}"
            if "ssd" not in tiers:
                return None
            return f"local://{scratch / 'calibration'}?{base}&ssd={_ssd_bytes(64, real)}"

        calibration = ""
        try:
            costs = measure_load_costs(url_for, profile, block_tokens)
        except InvalidArgumentError as exc:  # e.g. the store's blocks are smaller than real
            costs = measure_load_costs(lambda ssd: url_for(ssd, None), profile, block_tokens)
            calibration = f"load times measured on a local store: {url} refused them ({exc})"
    ideal = work.ideal_hit_tokens()
    prompt_total = int(work.prompt_tokens.sum())
    summary = trace.summary()
    own = policies if not url else [r.config.system for r in runs]
    result.rows = _rows(runs, own, [] if url else peers, work)
    none = np.zeros_like(work.prompt_tokens)
    no_cache = {
        name: _ttft_summary(
            ttft.prefill_seconds(profile, ttft.GPUS[name], work.prompt_tokens, none)
        )
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
        "url": url,
        "working_set_blocks": working_set,
        "ideal_hit_tokens": ideal,
        "ideal_hit_ratio": round(ideal / max(1, prompt_total), 5),
        "belady_hit_tokens": {
            str(p): work.belady_hit_tokens(max(2, round(working_set * p / 100)))
            for p in sorted({*percents, *(ssd_percents or ())})
        },
        "load_costs": {"dram_ms": round(costs.dram_s * 1e3, 4),
                       "ssd_ms": None if costs.ssd_s is None else round(costs.ssd_s * 1e3, 4)},
        "gpus": {g: vars(ttft.GPUS[g]) for g in gpus},
        "ttft_no_cache": no_cache,
        "peers": peer_info,
        "runs": [_run_details(r, work, costs, gpus) for r in runs],
    }  # fmt: skip
    result.notes += _notes(work, size, full, costs, url, peer_info)
    if calibration:
        result.notes.append(calibration)
    return result


def _notes(work: Workload, size: int, full: bool, costs: ttft.LoadCosts, url: str | None,
           peer_info: dict[str, object]) -> list[str]:  # fmt: skip
    real = work.profile.bytes_per_token * work.block_tokens
    notes = [
        f"model {work.profile.name}: {work.profile.bytes_per_token:,} B/token per rank, "
        f"{work.block_tokens}-token blocks of {real:,} B",
        (
            f"blocks stored at their real size ({size:,} B)"
            if full
            else f"scaled: each block's payload is {size:,} B instead of {real:,} B and every "
            "capacity is a number of blocks, so hit counts are those of real-size blocks; bytes "
            "read and written are of the scaled payloads"
        ),
        "hit tokens count leading blocks loaded and verified bit for bit; a request stores "
        "every block after its hit, with its parent key",
        f"DRAM+SSD runs split each capacity {1 - SSD_SHARE:.0%} DRAM / {SSD_SHARE:.0%} SSD "
        "(admission: the engine default)",
        "TTFT is a MODEL: prefill = (2 P (n-h) + 2 L d (n^2-h^2)) / (tp x peak x mfu), plus "
        f"measured load time per real-size block (DRAM {costs.dram_s * 1e3:.3f} ms"
        + (f", SSD {costs.ssd_s * 1e3:.3f} ms" if costs.ssd_s is not None else "")
        + ") plus the host-to-GPU copy at the profile's bandwidth",
    ]
    if url:
        notes.append(f"replayed once against {url} (its own policy and capacity)")
    for peer, info in peer_info.items():
        assert isinstance(info, dict)
        if info.get("error"):
            package = PEERS[peer][0]
            notes.append(f"{peer}: absent or failed: {info['error']} (skipped; `bash "
                         f".ci/engines.sh {package}` builds .venv-{package}, which is found "
                         f"by itself, or name a Python with --{package}-python)")  # fmt: skip
        else:
            notes.append(f"{peer}: version {info.get('version')} via {info.get('python')}")
            if info.get("note"):
                notes.append(f"{peer}: {info['note']}")
    return notes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("trace")
    src.add_argument("--trace", metavar="JSONL", help="replay this trace instead of generating")
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
    store.add_argument("--policies", default="lru,s3fifo,prefix")
    store.add_argument("--tiers", default="dram,ssd", help="dram (DRAM only), ssd (DRAM+SSD)")
    store.add_argument("--full", action="store_true", help="store real-size blocks (slow)")
    store.add_argument("--payload", type=int, default=DEFAULT_PAYLOAD,
                       help="bytes per scaled block")  # fmt: skip
    store.add_argument("--url", help="replay once against this store (any Client.connect URL)")
    store.add_argument("--dir", help="scratch directory for SSD stores (O_DIRECT capable)")
    store.add_argument("--gpus", default="h100", help=f"TTFT profiles: {', '.join(ttft.GPUS)}")
    peers = parser.add_argument_group("peers")
    peers.add_argument("--peers", default=",".join(PEERS), help="peers to run ('' for none)")
    peers.add_argument("--vllm-python", help="Python with vllm (env KVOFFLOAD_VLLM_PYTHON)")
    peers.add_argument("--lmcache-python",
                       help="Python with lmcache (env KVOFFLOAD_LMCACHE_PYTHON)")  # fmt: skip


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def load_trace(args: argparse.Namespace) -> Trace:
    if args.trace:
        return read_jsonl(args.trace, seed=args.seed)
    shape = TraceShape(sessions=args.sessions, docqa_fraction=args.docqa,
                       arrival_rate=args.arrival_rate, think_time_s=args.think_time)  # fmt: skip
    return generate(shape, seed=args.seed)


def run_from_args(args: argparse.Namespace) -> TraceResult:
    trace = load_trace(args)
    if args.write_trace:
        write_jsonl(trace, args.write_trace)
    try:
        percents = [int(p) for p in _csv(args.capacities)]
        ssd_percents = [int(p) for p in _csv(args.ssd_capacities)] if args.ssd_capacities else None
    except ValueError:
        raise ConfigError("--capacities and --ssd-capacities take integers") from None
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
    )
