"""A stated model of time to first token (TTFT) per GPU profile, with measured load times.

No GPU runs here, so prefill is *modelled*:

    prefill_s(n, h) = [2 P (n - h) + 2 L d (n^2 - h^2)] / (tp x peak x mfu)

for a prompt of n tokens of which the first h come from the store: 2 P FLOPs per computed token
in the weight matmuls (P parameters) plus the attention of each computed token i over its i
predecessors (QK^T and AV: 4 d i FLOPs per layer, summed over i = h..n). The store's part is

    load_s = (blocks from DRAM) x t_dram + (blocks from SSD) x t_ssd + h x bytes_per_token / h2d

with t_dram and t_ssd measured in the same run (per block of a verified `get_many_into` batch of
blocks of the model's real size through the SDK, as the vLLM connector loads them) and the
host-to-GPU copy modelled at the stated bandwidth. Loading and computing are additive: the
connector loads a request's blocks before its forward pass, it does not overlap them.

The store is used the way the connector claims hits (`claim="cost"`): of the h hit blocks it
loads the leading count c that gives the least prefill_s(n, c) + load_s(c). The replay's
`lookup(keys, tiers=True)` says which tier holds each hit block, in key order (its segments);
prefill is concave in the loaded tokens and loading is linear within a segment, so the best c
is 0 or the end of a segment (the DRAM lead, then the SSD part, ...). Without segments (a
store that does not report them) the hit is taken as its DRAM blocks first. A store used this
way is never slower than no store; `claim="all"` loads every hit, as before.
TTFT = prefill_s + load_s; without a store it is prefill_s(n, 0).

With the KV stored in P layer parts (the connector's `layer_parts`), attention layer l waits
only for part l, so loading overlaps computing: TTFT = max(load_s + prefill_s / P, load_s / P +
prefill_s) (the first part's load and the last part's compute do not overlap anything), with
load_s measured on values of a part's size. Then the best count is wherever loading and
computing take about as long, so every block count of the hit is a candidate, as in the
connector's rule (connectors/vllm/claim.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvoffload.bench.trace.workload import ModelProfile
from kvoffload.client_sdk import Tier, TierRun

__all__ = ["GPUS", "GpuProfile", "LoadCosts", "Modelled", "prefill_seconds", "ttft_seconds"]


@dataclass(frozen=True)
class GpuProfile:
    name: str
    peak_flops: float  # dense bf16 tensor FLOP/s (vendor datasheet)
    mfu: float  # assumed fraction of peak that prefill reaches
    h2d_bytes_per_s: float  # pinned host -> GPU copy bandwidth (assumed)


GPUS: dict[str, GpuProfile] = {
    "h100": GpuProfile("H100 SXM", 989e12, 0.5, 50e9),  # PCIe Gen5 x16
    "a100": GpuProfile("A100 80GB", 312e12, 0.5, 25e9),  # PCIe Gen4 x16
    "l40s": GpuProfile("L40S", 362e12, 0.5, 25e9),  # PCIe Gen4 x16
}


@dataclass(frozen=True)
class LoadCosts:
    """Seconds to load one block of the model's real size, measured through the SDK (per
    block of a batched read)."""

    dram_s: float
    ssd_s: float | None = None  # None: no SSD tier was measured


def prefill_seconds(
    model: ModelProfile,
    gpu: GpuProfile,
    prompt: npt.NDArray[np.int64],
    cached: npt.NDArray[np.int64],
) -> npt.NDArray[np.float64]:
    """Modelled prefill time of each prompt, its first `cached` tokens loaded, not computed."""
    n = prompt.astype(np.float64)
    # A trace's last block may be partial (Mooncake's): a hit on it covers the prompt, no more.
    h = np.minimum(cached, prompt).astype(np.float64)
    flops = 2 * model.params * (n - h) + 2 * model.num_layers * model.hidden_size * (n * n - h * h)
    result: npt.NDArray[np.float64] = flops / (model.tp_size * gpu.peak_flops * gpu.mfu)
    return result


@dataclass(frozen=True)
class Modelled:
    """Modelled TTFT of each request and the hit blocks the claim rule chose to load."""

    seconds: npt.NDArray[np.float64]
    loaded_blocks: npt.NDArray[np.int64]


def ttft_seconds(
    model: ModelProfile,
    gpu: GpuProfile,
    prompt: npt.NDArray[np.int64],
    hit_blocks: npt.NDArray[np.int64],
    ssd_blocks: npt.NDArray[np.int64],
    block_tokens: int,
    costs: LoadCosts,
    claim: str = "cost",
    runs: Sequence[TierRun] | None = None,
    parts: int = 1,
) -> Modelled:
    """Modelled TTFT of each request: prefill of what was not loaded plus loading what was.
    `runs`: each request's hit blocks by tier, in key order (else DRAM blocks first);
    `parts`: layer parts per block (loads overlap compute when more than one).

    Raises:
        ValueError: `claim` is neither "cost" nor "all".
    """
    if claim not in ("cost", "all"):
        raise ValueError(f"claim must be 'cost' or 'all', not {claim!r}")
    ssd_s = costs.ssd_s if costs.ssd_s is not None else costs.dram_s
    if parts > 1:
        if runs is None:  # DRAM blocks first
            runs = [TierRun(((Tier.DRAM, int(h - s)), (Tier.SSD, int(s))))
                    for h, s in zip(hit_blocks, ssd_blocks, strict=True)]  # fmt: skip
        return _overlapped(model, gpu, prompt, hit_blocks, block_tokens, costs, claim, runs,
                           parts)  # fmt: skip
    if runs is not None:
        return _by_segments(model, gpu, prompt, hit_blocks, block_tokens, costs, claim, runs)
    dram_blocks = hit_blocks - ssd_blocks
    copy_s = block_tokens * model.bytes_per_token / gpu.h2d_bytes_per_s

    def total(loaded: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        from_dram = np.minimum(loaded, dram_blocks)
        load = from_dram * costs.dram_s + (loaded - from_dram) * ssd_s + loaded * copy_s
        t: npt.NDArray[np.float64] = (
            prefill_seconds(model, gpu, prompt, loaded * block_tokens) + load
        )
        return t

    if claim == "all":
        return Modelled(total(hit_blocks), hit_blocks)
    choices = np.stack([np.zeros_like(hit_blocks), dram_blocks, hit_blocks])
    times = np.stack([total(c) for c in choices])
    best = np.argmin(times, axis=0)  # ties go to loading less
    picked = np.take_along_axis(choices, best[None, :], axis=0)[0]
    seconds: npt.NDArray[np.float64] = np.take_along_axis(times, best[None, :], axis=0)[0]
    return Modelled(seconds, picked)


def _by_segments(
    model: ModelProfile,
    gpu: GpuProfile,
    prompt: npt.NDArray[np.int64],
    hit_blocks: npt.NDArray[np.int64],
    block_tokens: int,
    costs: LoadCosts,
    claim: str,
    runs: Sequence[TierRun],
) -> Modelled:
    """`ttft_seconds` with each request's hit blocks in their tiers: the candidates are 0 and
    every segment end (an SSD block costs the SSD's time; a block of a tier not measured here,
    REMOTE or UNKNOWN, the slowest measured time)."""
    per_block = _block_costs(costs, block_tokens * model.bytes_per_token / gpu.h2d_bytes_per_s)
    n = len(prompt)
    who, loaded, load = list(range(n)), [0] * n, [0.0] * n  # candidate 0 of every request
    for i, run in enumerate(runs):
        at, spent, hit = 0, 0.0, int(hit_blocks[i])
        for tier, count in run.slice(0, hit).segments:
            at, spent = at + count, spent + count * per_block[tier]
            who.append(i)
            loaded.append(at)
            load.append(spent)
        if at < hit:  # hits the lookup did not report: the slowest cost
            who.append(i)
            loaded.append(hit)
            load.append(spent + (hit - at) * per_block[Tier.UNKNOWN])
    idx = np.asarray(who, dtype=np.int64)
    blocks = np.asarray(loaded, dtype=np.int64)
    times = prefill_seconds(model, gpu, prompt[idx], blocks * block_tokens) + np.asarray(load)
    if claim == "all":
        last = np.zeros(n, dtype=np.int64)
        np.maximum.at(last, idx, np.arange(len(idx)))  # each request's last candidate: all
        return Modelled(times[last], blocks[last])
    order = np.lexsort((blocks, times, idx))  # per request: fastest, then loading less
    first = order[np.r_[True, idx[order][1:] != idx[order][:-1]]]
    return Modelled(times[first], blocks[first])


def _block_costs(costs: LoadCosts, copy_s: float) -> dict[Tier, float]:
    """Seconds to load one block from each tier (REMOTE and UNKNOWN: the slowest measured)."""
    slowest = max(costs.dram_s, costs.ssd_s or 0.0)
    return {Tier.DRAM: costs.dram_s + copy_s, Tier.SSD: (costs.ssd_s or costs.dram_s) + copy_s,
            Tier.REMOTE: slowest + copy_s, Tier.UNKNOWN: slowest + copy_s}  # fmt: skip


def _overlapped(
    model: ModelProfile,
    gpu: GpuProfile,
    prompt: npt.NDArray[np.int64],
    hit_blocks: npt.NDArray[np.int64],
    block_tokens: int,
    costs: LoadCosts,
    claim: str,
    runs: Sequence[TierRun],
    parts: int,
) -> Modelled:
    """`ttft_seconds` with loads overlapping compute (layer parts): every block count of each
    request's hit is a candidate."""
    per_block = _block_costs(costs, block_tokens * model.bytes_per_token / gpu.h2d_bytes_per_s)
    seconds = np.zeros(len(prompt))
    picked = np.zeros(len(prompt), dtype=np.int64)
    for i, run in enumerate(runs):
        hit = int(hit_blocks[i])
        tiers = [t for t, count in run.slice(0, hit).segments for _ in range(count)]
        tiers += [Tier.UNKNOWN] * (hit - len(tiers))
        load = np.concatenate([[0.0], np.cumsum([per_block[t] for t in tiers])])
        counts = np.arange(hit + 1, dtype=np.int64)
        compute = prefill_seconds(model, gpu, np.full(hit + 1, prompt[i]), counts * block_tokens)
        total = np.maximum(load + compute / parts, load / parts + compute)
        best = hit if claim == "all" else int(np.argmin(total))  # ties: loading less
        seconds[i], picked[i] = total[best], best
    return Modelled(seconds, picked)
