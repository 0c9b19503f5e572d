"""`bench trace`'s results: per-run details, rows, notes and the printed tables."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

from kvoffload.bench.common import BenchResult, Row
from kvoffload.bench.trace import ttft
from kvoffload.bench.trace.model import (
    CDF_POINTS,
    PEERS,
    SSD_SHARE,
    Run,
    Workload,
    run_label,
)
from kvoffload.bench.trace.offline import optimum_hits
from kvoffload.client_sdk import Tier
from kvoffload.kvstore import POLICIES
from kvoffload.wire.membership import redact_url


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
        print_tables(self.details, console)
        super().print(console)


# ------------------------------------------------------------------------------- results


def quantiles(values: npt.NDArray[np.float64]) -> list[float]:
    return [round(float(v), 6) for v in np.quantile(values, np.linspace(0, 1, CDF_POINTS))]


def ttft_summary(seconds: npt.NDArray[np.float64]) -> dict[str, object]:
    ms = seconds * 1e3
    return {"mean_ms": round(float(ms.mean()), 3), "p50_ms": round(float(np.median(ms)), 3),
            "p90_ms": round(float(np.quantile(ms, 0.9)), 3), "cdf_ms": quantiles(ms)}  # fmt: skip


def run_details(run: Run, work: Workload, every: Mapping[int, ttft.LoadCosts] | None,
                 gpus: Sequence[str]) -> dict[str, object]:  # fmt: skip
    """One run's details; its modelled TTFT per GPU profile, and per `<gpu>+layers<P>` with the
    KV in P layer parts (`every`: the load costs measured for each P; 1 is whole blocks)."""
    c = run.config
    out: dict[str, object] = {
        "system": c.system, "tier": c.tier, "percent": c.percent,
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
        request_ms_cdf=quantiles(run.seconds * 1e3),
    )
    if run.load_s is not None:
        out["load_ms_cdf"] = quantiles(run.load_s * 1e3)
    if every and c.system in POLICIES:
        ssd_hits = run.ssd_hits if run.ssd_hits is not None else np.zeros_like(run.hit_blocks)
        model: dict[str, object] = {}
        for name, (parts, costs) in itertools.product(gpus, sorted(every.items())):
            args = (work.profile, ttft.GPUS[name], work.prompt_tokens, run.hit_blocks,
                    ssd_hits, work.block_tokens, costs)  # fmt: skip
            chosen = ttft.ttft_seconds(*args, runs=run.tier_runs, parts=parts)
            loaded = ttft.ttft_seconds(*args, claim="all", runs=run.tier_runs, parts=parts)
            skipped = int((run.hit_blocks - chosen.loaded_blocks).sum()) * work.block_tokens
            model[name if parts == 1 else f"{name}+layers{parts}"] = {
                **ttft_summary(chosen.seconds),
                "skipped_hit_tokens": skipped,  # hits the claim rule recomputed instead
                "load_all_mean_ms": round(float(loaded.seconds.mean()) * 1e3, 3),
            }
        out["ttft_model"] = model
        out["ssd_hit_blocks"] = int(ssd_hits.sum())
        if run.tier_runs is not None:  # where the lookups found the loaded hits
            out["lookup_tier_blocks"] = {
                t.name.lower(): sum(r.count(t) for r in run.tier_runs) for t in Tier
            }
            out["lookup_tier_segments"] = sum(len(r.segments) for r in run.tier_runs)
    return out


def result_rows(
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


def ttft_rows(runs: Sequence[dict[str, Any]], no_store: dict[str, Any], model: str,
              default_policy: str) -> list[Row]:  # fmt: skip
    """`ttft_model/<run>/<pct>%/<model>/<gpu>` (mean modelled TTFT) against `no_store` for each
    run and GPU profile, then `ttft_model/worst` (the least ratio among them) and
    `ttft_model/<layout>/<model>/<gpu>` for the default policy in each named layout."""
    rows = []
    for r in runs:
        for gpu, m in r.get("ttft_model", {}).items():
            label = run_label(r)
            base = float(no_store[gpu.split("+")[0]]["mean_ms"])  # h100+layers4: h100's
            note = f"{m['skipped_hit_tokens']:,} hit tokens recomputed (cheaper than loading)"
            rows.append(Row(f"ttft_model/{label}/{r['percent']}%/{model}/{gpu}",
                            float(m["mean_ms"]), "ms", "no_store", base, note=note))  # fmt: skip
            if r["tier"] not in ("dram", "dram+ssd") and r["system"] == default_policy:
                case = f"ttft_model/{r['tier']}/{model}/{gpu}"
                rows.append(Row(case, float(m["mean_ms"]), "ms", "no_store", base,
                                note=f"policy {default_policy}"))  # fmt: skip
    rated = [r for r in rows if r.ratio is not None and r.case.count("/") == 4]
    if rated:
        worst = min(rated, key=lambda r: r.ratio or 0.0)
        rows.append(Row("ttft_model/worst", worst.value, "ms", "no_store", worst.ref_value,
                        note=worst.case.removeprefix("ttft_model/")))  # fmt: skip
    return rows


def print_tables(details: dict[str, object], console: Console) -> None:
    if "live" in details:  # a live replay has no runs to tabulate: its rows say it all
        return
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
    systems = list(dict.fromkeys(run_label(r) for r in runs))
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
            match = [r for r in runs if r["percent"] == percent and run_label(r) == s]
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
    optimum = details.get("optimum")
    if isinstance(optimum, dict):
        _print_optimum(optimum, console)
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
            label = f"{run_label(r)} @ {r['percent']}%"
            t.add_row(label, f"{m['mean_ms']:.1f}", f"{m['p90_ms']:.1f}")
        console.print(t)


def _print_optimum(optimum: dict[str, Any], console: Console) -> None:
    """Hit tokens against the offline optimum (and LRU), per capacity, whole trace and window."""
    for scope, title in (("capacities", "whole trace"), ("window", "score window")):
        table_data = optimum.get(scope)
        if not isinstance(table_data, dict):
            continue
        labels = sorted(
            {k for e in table_data.values() for k, v in e.items() if isinstance(v, dict)}
        )
        t = Table(title=f"hit tokens / offline optimum (/ LRU), {title}")
        t.add_column("capacity", justify="right")
        t.add_column("optimum: share of accesses", justify="right")
        for label in labels:
            t.add_column(label, justify="right")
        for percent, e in table_data.items():
            cells = [f"{e[x]['of_optimum']:.3f} ({e[x]['of_lru'] or 0:.3f})" if x in e else ""
                     for x in labels]  # fmt: skip
            t.add_row(f"{percent}%", f"{e['optimum_block_ratio']:.3f}", *cells)
        console.print(t)


# ------------------------------------------------------------------------------- entry


def result_notes(work: Workload, size: int, full: bool, costs: ttft.LoadCosts, url: str | None,
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
        "(admission: the engine default); runs named +dram10+ssd100 have DRAM for 10% and an "
        "SSD for 100% of the working set",
        "TTFT is a MODEL: prefill = (2 P (n-h) + 2 L d (n^2-h^2)) / (tp x peak x mfu), plus "
        f"measured load time per real-size block (DRAM {costs.dram_s * 1e3:.3f} ms"
        + (f", SSD {costs.ssd_s * 1e3:.3f} ms" if costs.ssd_s is not None else "")
        + ", per block of a batched get_many_into) plus the host-to-GPU copy at the "
        "profile's bandwidth, load and compute additive; hits are claimed as the vLLM "
        "connector claims them: only where loading beats recomputing, per tier — up to the "
        "end of a tier segment of the lookup's run (lookup(keys, tiers=True)) — (the skipped "
        "hit tokens and the load-every-hit mean are in each run's details)",
        "profiles named <gpu>+layers<P> model the connector with layer_parts=P: each block is "
        "P values of a layer part's size (load times measured on such values, in details' "
        "layer_parts), and loading overlaps computing: TTFT = max(load + prefill/P, load/P + "
        "prefill), with the hit split where that is least, as the connector's claim rule does",
    ]
    if url:
        notes.append(f"replayed once against {redact_url(url)} (its own policy and capacity)")
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


def optimum_details(
    work: Workload,
    percents: Sequence[int],
    runs: Sequence[Run],
    score_window: tuple[float, float] | None = None,
) -> dict[str, object]:
    """For a trace that names its blocks: the offline optimum (Belady with bypass, leading
    hits) per capacity, as hit tokens and as a share of all block accesses, and each run's
    hit tokens as a multiple of it and of LRU's at the same capacity and tier; with
    `score_window` the same again over the requests arriving in it (`window`)."""
    working_set, accesses = work.working_set, work.block_accesses
    arrivals = np.array([r.arrival for r in work.trace.requests])
    scopes = {"all": np.ones(len(arrivals), dtype=bool)}
    if score_window is not None:
        scopes["window"] = (arrivals >= score_window[0]) & (arrivals < score_window[1])
    out: dict[str, object] = {
        "block_accesses": accesses,
        "first_touch_share": round(working_set / max(1, accesses), 4),
        "score_window_s": list(score_window) if score_window else None,
    }
    for scope, mask in scopes.items():
        scope_accesses = sum(len(c) for c, m in zip(work.chains, mask, strict=True) if m)
        by_percent: dict[str, object] = {}
        for percent in sorted(set(percents)):
            capacity = max(2, round(working_set * percent / 100))
            best = int(optimum_hits(work.chains, capacity)[mask].sum())
            entry: dict[str, object] = {
                "capacity_blocks": capacity,
                "optimum_hit_tokens": best * work.block_tokens,
                "optimum_block_ratio": round(best / max(1, scope_accesses), 4),
            }
            mine = [r for r in runs if r.config.percent == percent and r.hit_blocks is not None]
            lru = {r.config.tier: int(r.hit_blocks[mask].sum()) for r in mine
                   if r.hit_blocks is not None and r.config.system == "lru"}  # fmt: skip
            for r in mine:
                assert r.hit_blocks is not None
                hits = int(r.hit_blocks[mask].sum())
                base = lru.get(r.config.tier)
                entry[r.config.label] = {
                    "hit_tokens": hits * work.block_tokens,
                    "of_optimum": round(hits / best, 4) if best else None,
                    "of_lru": round(hits / base, 4) if base else None,
                }
            by_percent[str(percent)] = entry
        out["capacities" if scope == "all" else "window"] = by_percent
    return out


def named_notes(work: Workload, size: int, skipped_peers: Sequence[str]) -> list[str]:
    """Notes of a trace that names its blocks (Mooncake's hash_ids)."""
    real = work.profile.bytes_per_token * work.block_tokens
    notes = [
        f"blocks named by the trace's hash_ids ({work.block_tokens} tokens each): every block "
        f"is stored as a {size:,} B value standing for {real:,} B of {work.profile.name} KV "
        f"(scale 1:{real // max(1, size):,}); capacities are % of the trace's "
        f"{work.working_set:,} distinct blocks",
        "optimum: Belady with bypass over unit-size blocks, counting each request's leading "
        "run of resident blocks as its hit (details' optimum); a hit on a request's last, "
        "partial block counts 512 tokens in hit tokens and the prompt's own length in TTFT",
    ]
    if skipped_peers:
        notes.append(f"peers {', '.join(skipped_peers)} not run: they hash token ids, and "
                     "this trace has none")  # fmt: skip
    return notes
