"""KV-like test data shared by the codec tests (importable because tests/ holds conftest.py)."""

from __future__ import annotations

import numpy as np

_FLOAT_VIEWS = {"float16": "<f2", "float32": "<f4"}


def make_kv_block(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Raw bytes (flat uint8) of values shaped like KV: normal values with per-channel scales
    and a few outlier channels, as real keys have. bfloat16 values are float32 rounded to
    their upper half; "uint8" gives random bytes."""
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape))
    if dtype == "uint8":
        return rng.integers(0, 256, count, dtype=np.uint8)
    channels = shape[-1] if shape else 1
    scale = rng.lognormal(0.0, 0.7, channels).astype(np.float32)
    scale[rng.random(channels) < 0.1] *= 8.0
    values = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
    if dtype == "bfloat16":
        bits = values.reshape(-1).view(np.uint32)
        return ((bits + 0x8000) >> 16).astype("<u2").view(np.uint8)
    return values.astype(_FLOAT_VIEWS[dtype]).reshape(-1).view(np.uint8)


def as_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of raw bytes read as `dtype`."""
    if dtype == "bfloat16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return raw.view(_FLOAT_VIEWS[dtype]).astype(np.float32)
