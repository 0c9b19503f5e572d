"""A stated model of time to first token (TTFT) per GPU profile, with measured load times.

No GPU runs here, so prefill is *modelled*:

    prefill_s(n, h) = [2 P (n - h) + 2 L d (n^2 - h^2)] / (tp x peak x mfu)

for a prompt of n tokens of which the first h come from the store: 2 P FLOPs per computed token
in the weight matmuls (P parameters) plus the attention of each computed token i over its i
predecessors (QK^T and AV: 4 d i FLOPs per layer, summed over i = h..n). The store's part is

    load_s = (blocks from DRAM) x t_dram + (blocks from SSD) x t_ssd + h x bytes_per_token / h2d

with t_dram and t_ssd measured in the same run (a verified `get_into` of a block of the model's
real size through the SDK) and the host-to-GPU copy modelled at the stated bandwidth.
TTFT = prefill_s + load_s; without a store it is prefill_s(n, 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvoffload.bench.workload import ModelProfile

__all__ = ["GPUS", "GpuProfile", "LoadCosts", "prefill_seconds", "ttft_seconds"]


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
    """Seconds to load one block of the model's real size, measured through the SDK."""

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
    h = cached.astype(np.float64)
    flops = 2 * model.params * (n - h) + 2 * model.num_layers * model.hidden_size * (n * n - h * h)
    result: npt.NDArray[np.float64] = flops / (model.tp_size * gpu.peak_flops * gpu.mfu)
    return result


def ttft_seconds(
    model: ModelProfile,
    gpu: GpuProfile,
    prompt: npt.NDArray[np.int64],
    hit_blocks: npt.NDArray[np.int64],
    ssd_blocks: npt.NDArray[np.int64],
    block_tokens: int,
    costs: LoadCosts,
) -> npt.NDArray[np.float64]:
    """Modelled TTFT of each request: prefill of what was not hit plus loading what was."""
    hit_tokens = hit_blocks * block_tokens
    ssd_s = costs.ssd_s if costs.ssd_s is not None else costs.dram_s
    load = (
        (hit_blocks - ssd_blocks) * costs.dram_s
        + ssd_blocks * ssd_s
        + hit_tokens * model.bytes_per_token / gpu.h2d_bytes_per_s
    )
    result: npt.NDArray[np.float64] = prefill_seconds(model, gpu, prompt, hit_tokens) + load
    return result
