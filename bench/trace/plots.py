"""PNG plots for `kvoffload bench report` (matplotlib, Agg backend; imported only when drawing).

Each function takes the JSON-shaped dict a benchmark wrote and a path, draws one figure and
returns whether it drew anything (False when the input holds nothing to plot).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.trace.model import run_label

__all__ = ["hit_ratio_plot", "latency_cdf_plot", "pyplot", "throughput_plot"]

# Our policies solid, peers dashed; one colour per system across all figures.
_COLOURS = {
    "lru": "#1f77b4",
    "s3fifo": "#9467bd",
    "prefix": "#d62728",
    "vllm_lru": "#2ca02c",
    "vllm_arc": "#17becf",
    "lmcache": "#ff7f0e",
}


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(ax: Any, xlabel: str, ylabel: str | None, title: str, **legend: Any) -> None:
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(**{"fontsize": 7, **legend})


def _save(plt: Any, fig: Any, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def hit_ratio_plot(trace: dict[str, Any], path: Path) -> bool:
    """Hit ratio against capacity (% of the working set) per policy and peer; DRAM+SSD runs
    dotted; the offline Belady reference and the unbounded ideal in grey."""
    details = trace.get("details", {})
    runs = [r for r in details.get("runs", []) if "hit_ratio" in r]
    if not runs:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label in dict.fromkeys(run_label(r) for r in runs):
        points = sorted((r["percent"], r["hit_ratio"]) for r in runs if run_label(r) == label)
        system = label.removesuffix("+ssd")
        peer = system.startswith(("vllm", "lmcache"))
        style = ":" if label.endswith("+ssd") else ("--" if peer else "-")
        ax.plot(*zip(*points, strict=True), style, marker="o", ms=3, label=label,
                color=_COLOURS.get(system))  # fmt: skip
    total = float(details.get("trace", {}).get("prompt_tokens_total", 0)) or 1.0
    belady = sorted((int(p), v / total) for p, v in details.get("belady_hit_tokens", {}).items())
    if belady:
        ax.plot(*zip(*belady, strict=True), "-", color="0.6", lw=3, alpha=0.5,
                label="Belady (offline reference)")  # fmt: skip
    ax.axhline(details.get("ideal_hit_ratio", 0), color="0.4", lw=0.8, ls="--",
               label="unbounded store")  # fmt: skip
    model = details.get("model", {}).get("name", "")
    _finish(ax, "capacity, % of the working set", "hit ratio (hit tokens / prompt tokens)",
            f"Multi-turn trace replay ({model}, {details.get('block_tokens')}-token blocks)",
            fontsize=8, ncol=2, loc="lower right")  # fmt: skip
    return _save(plt, fig, path)


def _size_bytes(label: str) -> float:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if label.endswith(unit):
            return float(label[: -len(unit)]) * factor
    return float("nan")


def throughput_plot(results: dict[str, dict[str, Any]], path: Path) -> bool:
    """GB/s against block size for the engine (next to memcpy) and the SSD tier (next to raw
    O_DIRECT), the network bench (next to a raw socket loop) and the NVMe/TCP front (next to
    the native front) when present."""
    panels = []
    for bench, ops, ref in (
        ("engine", ("put", "get_into", "client_put", "client_get_into"), "memcpy"),
        ("ssd", ("read", "write"), "odirect"),
        ("net", ("get", "put"), "raw_socket"),
        ("nvme", ("store", "retrieve"), "native"),
    ):
        rows = [r for r in results.get(bench, {}).get("rows", []) if r.get("unit") == "GB/s"]
        if rows:
            panels.append((bench, ops, ref, rows))
    if not panels:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (bench, ops, ref, rows) in zip(axes[0], panels, strict=True):
        for op in ops:
            mine = sorted(
                (_size_bytes(r["case"].split("/", 1)[1]), r["value"], r.get("ref_value"))
                for r in rows
                if r["case"].split("/", 1)[0] == op and r.get("ref") == ref
            )
            if not mine:
                continue
            sizes = [m[0] for m in mine]
            line = ax.plot(sizes, [m[1] for m in mine], marker="o", label=f"{op}")[0]
            limits = [m[2] for m in mine]
            if all(v is not None for v in limits):
                ax.plot(sizes, limits, ls="--", color=line.get_color(), alpha=0.6,
                        label=f"{ref} ({op})")  # fmt: skip
        ax.set_xscale("log", base=2)
        _finish(
            ax, "block size (bytes)", "GB/s", f"bench {bench}: kvoffload (solid) vs {ref} (dashed)"
        )
    return _save(plt, fig, path)


def latency_cdf_plot(trace: dict[str, Any], percent: int, path: Path) -> bool:
    """At one capacity: CDF of the measured time per request of every system, and CDF of the
    modelled TTFT of our policies next to no store at all."""
    details = trace.get("details", {})
    runs = [r for r in details.get("runs", []) if r.get("percent") == percent and "hit_ratio" in r]
    if not runs:
        return False
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = np.linspace(0, 1, len(runs[0]["request_ms_cdf"]))
    for r in runs:
        system = r["system"]
        left.plot(r["request_ms_cdf"], levels, label=run_label(r), color=_COLOURS.get(system),
                  ls=":" if r["tier"] != "dram" else "-")  # fmt: skip
    left.set_xscale("log")
    _finish(left, "ms per request (lookup + loads + stores), measured", "fraction of requests",
            f"time per request at {percent}% of the working set")  # fmt: skip
    base = details.get("ttft_no_cache", {})
    gpu = next(iter(base), None)
    if gpu is not None:
        right.plot(base[gpu]["cdf_ms"], levels, color="0.3", lw=2, label="no store (model)")
        for r in runs:
            model = r.get("ttft_model", {}).get(gpu)
            if model:
                right.plot(model["cdf_ms"], levels, label=run_label(r),
                           color=_COLOURS.get(r["system"]),
                           ls=":" if r["tier"] != "dram" else "-")  # fmt: skip
        name = details.get("gpus", {}).get(gpu, {}).get("name", gpu)
        right.set_xscale("log")
        _finish(right, "TTFT ms (model with measured load times)", None,
                f"TTFT, modelled for {name}, at {percent}%")  # fmt: skip
    return _save(plt, fig, path)
