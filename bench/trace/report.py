"""`kvoffload bench report`: run the benchmarks that exist (engine, ssd, net, nvme, codecs,
trace) and write `<out>/<date>/report.md` with their tables, PNG plots and the JSON of every
bench.

Sizes default to a run of some minutes on a small machine; every bench's size has a flag.
Plots need matplotlib (the `bench` extra); without it the report is written without them and
says so. A bench that is not registered, or that cannot run here (`bench codecs` without the
model, say), is named in the report with its reason and the others still run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.util
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from kvoffload.bench.common import BenchResult, Row, machine_info
from kvoffload.bench.registry import BENCHES
from kvoffload.bench.trace import plots, ttft
from kvoffload.bench.trace.model import run_label
from kvoffload.bench.trace.workload import PROFILES
from kvoffload.errors import ConfigError, KVOffloadError

__all__ = [
    "HELP",
    "add_arguments",
    "analyse",
    "goal_lines",
    "render",
    "rerender",
    "run",
    "run_from_args",
]

HELP = "run engine, ssd, net, nvme, codecs and trace benches; write report.md with plots"
REPORTED = ("engine", "ssd", "net", "nvme", "codecs", "trace")
TITLES = {
    "engine": "DRAM tier vs memcpy",
    "ssd": "SSD tier vs raw O_DIRECT",
    "net": "Network vs raw socket, Redis, LMCache",
    "nvme": "NVMe/TCP front vs the native front",
    "codecs": "Codecs on a real KV cache vs zstd-1 and lz4",
}

GOAL_PERCENT = 30
GOAL_VS_LRU = 1.2


def _bench_args(name: str, argv: Sequence[str]) -> argparse.Namespace:
    module = importlib.import_module(BENCHES[name])
    parser = argparse.ArgumentParser(prog=f"kvoffload bench {name}")
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def _run_bench(name: str, argv: Sequence[str]) -> BenchResult:
    result: BenchResult = importlib.import_module(BENCHES[name]).run_from_args(
        _bench_args(name, argv)
    )
    return result


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.3g} {unit}"


def _rows_table(data: dict[str, Any]) -> str:
    rows = []
    for r in data.get("rows", []):
        ratio = r.get("ratio")
        note = r.get("note", "")
        rows.append([f"`{r['case']}`", _fmt(r["value"], r["unit"]), r.get("ref") or "",
                     _fmt(r.get("ref_value"), r["unit"]) if r.get("ref") else "",
                     "n/a" if ratio is None else f"{ratio:.2f}×", note])  # fmt: skip
    return _table(["case", "kvoffload", "reference", "ref value", "ratio", "note"], rows)


def _hits(details: dict[str, Any], label: str, percent: int) -> int | None:
    for r in details.get("runs", []):
        if run_label(r) == label and r["percent"] == percent and "hit_tokens" in r:
            return int(r["hit_tokens"])
    return None


def goal_lines(details: dict[str, Any], percent: int = GOAL_PERCENT) -> list[str]:
    """The issue's goal at `percent`: prefix >= 1.2x LRU hit tokens and >= vLLM's ARC."""
    prefix = _hits(details, "prefix", percent)
    if prefix is None:
        return [f"No prefix-aware run at {percent}% of the working set: goal not evaluated."]
    out = []
    for ref, goal in (("lru", GOAL_VS_LRU), ("vllm_arc", 1.0)):
        other = _hits(details, ref, percent)
        if other is None:
            errors = (r.get("error") for r in details.get("runs", [])
                      if r["system"] == ref and r["percent"] == percent)  # fmt: skip
            reason = next(errors, "not run")
            out.append(f"prefix vs {ref} at {percent}%: not measured ({reason}).")
            continue
        ratio = prefix / other if other else float("inf")
        verdict = "met" if ratio >= goal else "**not met**"
        out.append(f"prefix vs {ref} at {percent}%: {prefix:,} / {other:,} hit tokens = "
                   f"**{ratio:.3f}×** (goal ≥ {goal:g}×: {verdict}).")  # fmt: skip
    return out


def _by_capacity(runs: list[dict[str, Any]], labels: list[str], percents: list[int], field: str,
                 fmt: str, failed: str) -> list[list[object]]:  # fmt: skip
    """One row per capacity, one cell per system: `field` formatted, `failed` for a run without
    it, empty where there was no run."""
    rows: list[list[object]] = []
    for p in percents:
        row: list[object] = [f"{p}%"]
        for label in labels:
            match = [r for r in runs if run_label(r) == label and r["percent"] == p]
            row.append(fmt.format(match[0][field]) if match and field in match[0]
                       else (failed if match else ""))  # fmt: skip
        rows.append(row)
    return rows


def _trace_section(data: dict[str, Any], figures: dict[str, str]) -> list[str]:
    d = data.get("details", {})
    t = d.get("trace", {})
    runs = d.get("runs", [])
    labels = list(dict.fromkeys(run_label(r) for r in runs))
    percents = sorted({r["percent"] for r in runs})
    total = float(t.get("prompt_tokens_total", 0)) or 1.0
    belady = d.get("belady_hit_tokens", {})
    out = ["## Workload benchmark: multi-turn trace replay", ""]
    out.append(
        f"Trace: {t.get('source')}; {t.get('requests', 0):,.0f} requests in "
        f"{t.get('conversations', 0):,.0f} sessions (chat and document QA), mean prompt "
        f"{t.get('prompt_tokens_mean', 0):,.0f} tokens (p50 {t.get('prompt_tokens_p50', 0):,.0f}, "
        f"max {t.get('prompt_tokens_max', 0):,.0f}), mean output "
        f"{t.get('output_tokens_mean', 0):,.0f} tokens, {t.get('turns_mean', 0):.1f} turns per "
        f"session. Model profile {d.get('model', {}).get('name')} "
        f"({d.get('model', {}).get('bytes_per_token', 0):,} B/token per rank), "
        f"{d.get('block_tokens')}-token blocks; working set "
        f"{d.get('working_set_blocks', 0):,} blocks; an unbounded store would hit "
        f"{d.get('ideal_hit_ratio', 0):.3f} of all prompt tokens."
    )
    out.append("")
    if "hit_ratio" in figures:
        out += [f"![hit ratio vs capacity]({figures['hit_ratio']})", ""]
    out += ["### Hit ratio (hit tokens ÷ prompt tokens) by capacity", ""]
    rows = _by_capacity(runs, labels, percents, "hit_ratio", "{:.3f}", "n/a")
    for row, p in zip(rows, percents, strict=True):
        ref = belady.get(str(p))
        row.append("" if ref is None else f"{ref / total:.3f}")
    out += [_table(["capacity", *labels, "Belady (offline)"], rows), ""]
    out += ["### Goal at 30% of the working set", ""]
    out += [f"- {line}" for line in goal_lines(d)] + [""]
    out += ["### Time per request, measured (mean ms: lookup + loads + stores)", ""]
    rows = _by_capacity(runs, labels, percents, "ms_per_request", "{:.2f}", "")
    out += [_table(["capacity", *labels], rows), ""]
    base = d.get("ttft_no_cache", {})
    if base:
        gpu = next(iter(base))
        name = d.get("gpus", {}).get(gpu, {}).get("name", gpu)
        out += [f"### TTFT, modelled for {name} (mean / p90 ms)", ""]
        rows = [["no store", f"{base[gpu]['mean_ms']:.1f}", f"{base[gpu]['p90_ms']:.1f}"]]
        for r in runs:
            m = r.get("ttft_model", {}).get(gpu)
            if m:
                rows.append([f"{run_label(r)} @ {r['percent']}%", f"{m['mean_ms']:.1f}",
                             f"{m['p90_ms']:.1f}"])  # fmt: skip
        out += [_table(["run", "mean", "p90"], rows), ""]
        costs = d.get("load_costs", {})
        out.append(
            f"Load time per real-size block ({d.get('block_bytes_real', 0):,} B), measured in "
            f"this run through the SDK: DRAM {costs.get('dram_ms')} ms, SSD "
            f"{costs.get('ssd_ms')} ms (one block at a time)."
        )
        out.append("")
    if "latency_cdf" in figures:
        out += [f"![latency CDFs]({figures['latency_cdf']})", ""]
    out += ["### Every case against its references (DESIGN §9 rows)", "", _rows_table(data), ""]
    return out


def render(results: dict[str, dict[str, Any]], figures: dict[str, str], analysis: str,
           command: str, missing: list[str]) -> str:  # fmt: skip
    """The report's markdown from the benches' JSON results."""
    any_result = next(iter(results.values()), {})
    machine = any_result.get("machine", machine_info())
    date = any_result.get("date", "")[:10]
    out = [f"# kvoffload benchmark report, {date}", ""]
    out.append(
        f"Machine: {machine.get('cpus')} CPUs ({machine.get('cpu') or 'unknown CPU'}), "
        f"{machine.get('platform')}, Python {machine.get('python')}, numpy "
        f"{machine.get('numpy')}, kvoffload {machine.get('kvoffload')}. Every bench measures its "
        "reference in the same run; ratios above 1 mean kvoffload is better."
    )
    out += ["", f"Command: `{command}`", ""]
    for note in missing:
        out.append(f"- {note}")
    if missing:
        out.append("")
    if "trace" in results:
        out += _trace_section(results["trace"], figures)
        if analysis:
            out += ["### Where prefix-aware eviction wins and loses", "", analysis, ""]
    for name, title in TITLES.items():
        if name not in results:
            continue
        out += [f"## bench {name}: {title}", ""]
        if name == "engine" and "throughput" in figures:
            out += [f"![throughput vs block size]({figures['throughput']})", ""]
        out += [_rows_table(results[name]), ""]
    out += ["## Notes", ""]
    for name, data in results.items():
        for note in data.get("notes", []):
            out.append(f"- {name}: {note}")
    return "\n".join(out) + "\n"


def analyse(details: dict[str, Any]) -> str:
    """What the numbers say about prefix-aware eviction, in words, with the numbers."""
    runs = details.get("runs", [])
    total = float(details.get("trace", {}).get("prompt_tokens_total", 0)) or 1.0
    belady = details.get("belady_hit_tokens", {})
    percents = sorted({r["percent"] for r in runs if r["tier"] == "dram"})
    lines = []
    for p in percents:
        prefix, lru = _hits(details, "prefix", p), _hits(details, "lru", p)
        if prefix is None or not lru:
            continue
        parts = [f"{p}%: prefix/lru {prefix / lru:.3f}×"]
        for peer in ("vllm_lru", "vllm_arc", "lmcache", "s3fifo"):
            other = _hits(details, peer, p)
            if other:
                parts.append(f"prefix/{peer} {prefix / other:.3f}×")
        ref = belady.get(str(p))
        if ref:
            parts.append(f"Belady/lru {ref / lru:.3f}× (Belady hit ratio {ref / total:.3f})")
        lines.append("- " + ", ".join(parts))
    text = "\n".join(lines)
    text += (
        "\n\nWhy the numbers look like this. A request loads its hit blocks head first and then "
        "stores its new blocks, so within one conversation the head is always the least "
        "recently used block. LRU therefore evicts a conversation's head first and its tail, "
        "now unreachable, right after it: at the granularity of conversations it makes the "
        "same choice as prefix-aware eviction (the conversation idle longest), which evicts the "
        "same conversation tail first. The two differ only for the conversation that is partly "
        "evicted when it comes back: prefix-aware keeps a usable head (a partial hit, and only "
        "the lost tail is stored again), LRU keeps an unusable tail (no hit, the whole chain is "
        "computed and stored again, which evicts more). That is the whole of prefix-aware's "
        "gain on this trace (the prefix/lru column). vLLM's LRU orders a request's blocks tail "
        "before head explicitly, so it behaves like prefix-aware eviction (prefix/vllm_lru); "
        "its ARC splits the cache between blocks seen once and blocks seen again, and LMCache's "
        "local CPU backend keeps its own LRU; both are compared as measured. "
        "S3-FIFO is built for one-hit wonders: a new block waits in a short probationary "
        "queue, but a conversation's newest blocks are read only at its next turn, often "
        "after probation has ended, so they are dropped first. "
        "The offline Belady column bounds what any policy could gain on this trace: with "
        "exponential think times, which conversation returns next is not predictable from "
        "recency, so the headroom between LRU and Belady is mostly out of reach online. "
        "DRAM+SSD runs get the same number of block slots split 1:3, but a block read back "
        "from the SSD holds a slot in both tiers, and the SSD's admission filter (puts, "
        "lookups and reads must add up to two uses) keeps blocks that were stored and never "
        "looked up again off the SSD, which also drops some that would have been hit later."
    )
    return text + _ttft_words(details)


def _ttft_words(details: dict[str, Any]) -> str:
    """Put the measured load time of a block next to the modelled cost of recomputing it."""
    costs = details.get("load_costs", {})
    model = PROFILES.get(details.get("model", {}).get("name", ""))
    gpus = details.get("gpus", {})
    if model is None or not gpus or not costs.get("dram_ms"):
        return ""
    gpu = ttft.GPUS[next(iter(gpus))]
    bt = int(details.get("block_tokens", 16))
    n = int(details.get("trace", {}).get("prompt_tokens_mean", 2000))
    per_block = ttft.prefill_seconds(
        model, gpu, np.array([n], dtype=np.int64), np.array([n - bt], dtype=np.int64)
    )[0]
    h2d = model.bytes_per_token * bt / gpu.h2d_bytes_per_s
    ssd = costs.get("ssd_ms")
    text = (
        f"\n\nTTFT. In the model, recomputing one {bt}-token block at the mean prompt length "
        f"costs {per_block * 1e3:.2f} ms on an {gpu.name} ({model.name}); loading it costs the "
        f"measured {costs['dram_ms']:.2f} ms from DRAM"
        + (f" or {ssd:.2f} ms from the SSD" if ssd else "")
        + f", plus {h2d * 1e3:.3f} ms of host-to-GPU copy (per block of a batched, verified "
        "`get_many_into` through the SDK on a 2-vCPU VM). The model overlaps nothing and "
        "claims hits as the vLLM connector does: a request loads its hit blocks only where "
        "that beats recomputing them, so the store never makes a request slower than no store."
    )
    return text


def run(
    *,
    out_dir: str = "results",
    date: str | None = None,
    benches: Sequence[str] = REPORTED,
    argv: dict[str, list[str]] | None = None,
    command: str = "kvoffload bench report",
    console: Console | None = None,
) -> BenchResult:
    """Run the benches that are registered (of `benches`) and write the report.

    Raises:
        ConfigError: the output directory cannot be written.
    """
    console = console or Console(stderr=True)
    day = date or _dt.datetime.now(_dt.timezone.utc).date().isoformat()
    folder = Path(out_dir) / day
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create report folder {folder}: {exc}") from None
    results: dict[str, dict[str, Any]] = {}
    missing = []
    for name in benches:
        if name not in BENCHES:
            missing.append(f"bench {name}: not part of this build (not registered), not run")
            continue
        console.print(f"[bold]report:[/] running bench {name} ...")
        t0 = time.perf_counter()
        try:
            result = _run_bench(name, (argv or {}).get(name, []))
        except (KVOffloadError, ImportError, OSError) as exc:  # the report goes on without it
            why = " (an optional package; see the README's Set up)" * isinstance(exc, ImportError)
            missing.append(f"bench {name}: could not run here, not in this report: {exc}{why}")
            console.print(f"[bold]report:[/] bench {name} could not run: {exc}")
            continue
        result.write_json(folder / f"{name}.json")
        results[name] = json.loads((folder / f"{name}.json").read_text())
        console.print(f"[bold]report:[/] bench {name} took {time.perf_counter() - t0:.0f} s")
    (folder / "report.json").write_text(json.dumps({"command": command, "missing": missing}))
    return _write(folder, results, command, missing)


def rerender(folder: str | Path) -> BenchResult:
    """Write `folder`/report.md again from the JSON a previous run left there (after a change
    to the report's text or plots), without running any bench.

    Raises:
        ConfigError: `folder` holds no bench results.
    """
    path = Path(folder)
    results = {
        p.stem: json.loads(p.read_text())
        for p in sorted(path.glob("*.json"))
        if p.name != "report.json"
    }
    if not results:
        raise ConfigError(f"{path} holds no bench results (*.json) to render")
    meta_path = path / "report.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    return _write(path, results, meta.get("command", "kvoffload bench report"),
                  list(meta.get("missing", [])))  # fmt: skip


def _write(folder: Path, results: dict[str, dict[str, Any]], command: str,
           missing: list[str]) -> BenchResult:  # fmt: skip
    missing = list(missing)
    figures = _draw(results, folder, missing)
    analysis = analyse(results["trace"].get("details", {})) if "trace" in results else ""
    report = folder / "report.md"
    report.write_text(render(results, figures, analysis, command, missing))
    summary = BenchResult("report")
    if "trace" in results:
        summary.rows = [Row(**{k: v for k, v in r.items() if k != "ratio"})
                        for r in results["trace"].get("rows", [])
                        if r["case"] == f"hit_tokens/prefix/{GOAL_PERCENT}%"]  # fmt: skip
        summary.notes += goal_lines(results["trace"].get("details", {}))
    summary.notes.append(f"report written to {report}")
    return summary


def _draw(results: dict[str, dict[str, Any]], folder: Path, missing: list[str]) -> dict[str, str]:
    if importlib.util.find_spec("matplotlib") is None:
        missing.append("plots: matplotlib is not installed (pip install 'kvoffload[bench]')")
        return {}
    figures: dict[str, str] = {}
    jobs: list[tuple[str, Callable[[Path], bool]]] = [
        ("throughput", lambda p: plots.throughput_plot(results, p)),
    ]
    if "trace" in results:
        trace = results["trace"]
        jobs.append(("hit_ratio", lambda p: plots.hit_ratio_plot(trace, p)))
        percents = sorted({r["percent"] for r in trace.get("details", {}).get("runs", [])})
        if percents:
            near = min(percents, key=lambda x: abs(x - GOAL_PERCENT))
            jobs.append(("latency_cdf", lambda p: plots.latency_cdf_plot(trace, near, p)))
    for name, draw in jobs:
        path = folder / f"{name}.png"
        if draw(path):
            figures[name] = path.name
    return figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="results", help="folder for <date>/report.md")
    parser.add_argument(
        "--from",
        dest="render_from",
        metavar="DIR",
        help="only re-render DIR/report.md from the JSON an earlier run left",
    )
    parser.add_argument("--date", help="report folder name (default: today, UTC)")
    parser.add_argument("--only", default=",".join(REPORTED), help="benches to run")
    parser.add_argument("--dir", help="scratch directory for SSD stores (O_DIRECT capable)")
    parser.add_argument("--engine-working-set", type=int, default=64, metavar="MiB")
    parser.add_argument("--engine-rounds", type=int, default=3)
    parser.add_argument("--ssd-size", type=int, default=64, metavar="MiB")
    parser.add_argument("--ssd-entries", type=int, default=100_000)
    parser.add_argument("--net-working-set", type=int, default=32, metavar="MiB")
    parser.add_argument(
        "--net-args",
        default="",
        help='more options for bench net, e.g. "--cpu-requests 0 --nixl no"',
    )
    parser.add_argument("--nvme-working-set", type=int, default=16, metavar="MiB")
    parser.add_argument("--codecs-rounds", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=120, help="trace sessions")
    parser.add_argument("--model", default="llama-3.1-8b", help="trace model profile")
    parser.add_argument("--tiers", default="dram,ssd", help="trace tiers: dram, ssd")
    parser.add_argument("--capacities", default="10,20,30,50,70,100")
    parser.add_argument("--ssd-capacities", default="10,30,50")
    parser.add_argument("--peers", default="vllm_lru,vllm_arc,lmcache")
    parser.add_argument("--vllm-python", help="Python with vllm (env KVOFFLOAD_VLLM_PYTHON)")
    parser.add_argument(
        "--lmcache-python", help="Python with lmcache (env KVOFFLOAD_LMCACHE_PYTHON)"
    )


def run_from_args(args: argparse.Namespace) -> BenchResult:
    if args.render_from:
        return rerender(args.render_from)
    scratch = ["--dir", args.dir] if args.dir else []
    trace = ["--sessions", str(args.sessions), "--model", args.model, "--tiers", args.tiers,
             "--capacities", args.capacities,
             "--ssd-capacities", args.ssd_capacities, "--peers", args.peers, *scratch]  # fmt: skip
    for flag in ("vllm_python", "lmcache_python"):
        if getattr(args, flag):
            trace += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    argv = {
        "engine": ["--working-set", str(args.engine_working_set),
                   "--rounds", str(args.engine_rounds)],
        "ssd": ["--size", str(args.ssd_size), "--entries", str(args.ssd_entries),
                "--dir", args.dir or "."],
        "net": ["--working-set", str(args.net_working_set), *shlex.split(args.net_args)]
        + (["--lmcache-python", args.lmcache_python] if args.lmcache_python else []),
        "nvme": ["--working-set", str(args.nvme_working_set)],
        "codecs": ["--rounds", str(args.codecs_rounds)],
        "trace": trace,
    }  # fmt: skip
    return run(
        out_dir=args.out,
        date=args.date,
        benches=[b.strip() for b in args.only.split(",") if b.strip()],
        argv=argv,
        command="kvoffload " + " ".join(sys.argv[1:]) if sys.argv[1:] else "kvoffload bench report",
    )
