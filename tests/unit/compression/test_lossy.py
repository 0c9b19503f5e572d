"""Lossy codecs: error bounds, numpy and torch give the same bytes, bad input."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvdata import as_float32, make_kv_block

from kvoffload.compression import (
    PREAMBLE_BYTES,
    BlockSpec,
    CodecError,
    CodecMismatchError,
    CorruptEncodedError,
    UnsupportedCodecConfigError,
    as_payload,
    get_codec,
)

torch = pytest.importorskip("torch")

FLOATS = ["bfloat16", "float16", "float32"]
SPEC = BlockSpec.kv("bfloat16", 3, 2, 16, 64)


def _round_trip(name: str, raw: np.ndarray, spec: BlockSpec, backend: str) -> np.ndarray:
    codec = get_codec(name, backend=backend)
    return codec.decode(codec.encode(raw, spec))


@st.composite
def kv_blocks(draw: st.DrawFn) -> tuple[np.ndarray, BlockSpec]:
    dtype = draw(st.sampled_from(FLOATS))
    layers, heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    tokens, dim = draw(st.sampled_from([1, 5, 16, 48])), draw(st.sampled_from([2, 24, 64, 80]))
    spec = BlockSpec.kv(dtype, layers, heads, tokens, dim)
    raw = make_kv_block(dtype, spec.shape or (), draw(st.integers(0, 2**32 - 1)))
    return raw, spec


@pytest.mark.parametrize("name", ["fp8", "int4"])
@given(block=kv_blocks())
def test_numpy_and_torch_write_and_read_the_same_bytes(
    name: str, block: tuple[np.ndarray, BlockSpec]
) -> None:
    raw, spec = block
    by_numpy = get_codec(name, backend="numpy").encode(raw, spec)
    by_torch = get_codec(name, backend="torch").encode(raw, spec)
    assert bytes(by_numpy) == bytes(by_torch)
    # The tensor API (what a connector would call on the GPU) gives the same bytes too.
    kv = torch.from_numpy(raw.copy()).view(getattr(torch, spec.dtype)).reshape(spec.shape)
    tensor_payload = get_codec(name).encode_tensor(kv)  # type: ignore[attr-defined]
    assert tensor_payload.numpy().tobytes() == bytes(by_numpy)
    out = torch.empty_like(kv)
    get_codec(name).decode_tensor(tensor_payload, out)  # type: ignore[attr-defined]
    decoded = _round_trip(name, raw, spec, "numpy")
    assert out.reshape(-1).view(torch.uint8).numpy().tobytes() == decoded.tobytes()


@given(block=kv_blocks())
def test_fp8_error_bound(block: tuple[np.ndarray, BlockSpec]) -> None:
    raw, spec = block
    x = as_float32(raw, spec.dtype).reshape(spec.shape or ())
    y = as_float32(_round_trip("fp8", raw, spec, "numpy"), spec.dtype).reshape(x.shape)
    scale = np.abs(x).max(axis=(3, 4), keepdims=True) / 448
    # e4m3 keeps 3 mantissa bits (relative error 2^-4), subnormals are 2^-9 apart (absolute
    # 2^-10 of the scale), and the result is rounded to the block's dtype (at most 2^-8).
    bound = 2.0**-4 * np.abs(x) + 2.0**-10 * scale + 2.0**-8 * np.abs(y) + 1e-30
    assert np.all(np.abs(y - x) <= bound)


@given(block=kv_blocks())
def test_int4_error_bound(block: tuple[np.ndarray, BlockSpec]) -> None:
    raw, spec = block
    layers, _, heads, tokens, dim = spec.shape or (0,) * 5
    x = as_float32(raw, spec.dtype).reshape(spec.shape or ())
    y = as_float32(_round_trip("int4", raw, spec, "numpy"), spec.dtype).reshape(x.shape)

    def largest_divisor(n: int) -> int:
        return max(g for g in range(1, min(n, 32) + 1) if n % g == 0)

    gk, gv = largest_divisor(tokens), largest_divisor(dim)
    keys = x[:, 0].reshape(layers, heads, tokens // gk, gk, dim)
    values = x[:, 1].reshape(layers, heads, tokens, dim // gv, gv)
    bounds = []
    for group, axis in ((keys, 3), (values, 4)):
        low, high = group.min(axis=axis, keepdims=True), group.max(axis=axis, keepdims=True)
        # Half a step of 15 per range, float16 rounding of zero point and scale (2^-11 each,
        # over the whole range of codes), plus rounding the result to the block's dtype.
        step = (high - low) / 15
        bound = step / 2 + 2.0**-10 * (15 * step + np.abs(low)) + np.zeros_like(group)
        bounds.append(bound.reshape(layers, 1, heads, tokens, dim))
    bound = np.concatenate(bounds, axis=1) + 2.0**-8 * np.abs(y) + 1e-30
    assert np.all(np.abs(y - x) <= bound)


@pytest.mark.parametrize(("name", "bits"), [("fp8", 8), ("int4", 4)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_payload_sizes(name: str, bits: int, dtype: str) -> None:
    spec = BlockSpec.kv(dtype, 30, 3, 16, 64)  # SmolLM2-135M
    raw = make_kv_block(dtype, spec.shape or (), seed=0)
    elements = raw.size // spec.itemsize
    payload = get_codec(name).encode(raw, spec)
    meta = len(payload) - PREAMBLE_BYTES - elements * bits // 8
    if name == "fp8":
        assert meta == 4 * 30 * 2 * 3  # one float32 scale per layer, k/v and head
    else:  # float16 zero and scale: keys per channel per 16 tokens, values per 32 channels
        assert meta == 4 * (30 * 3 * 1 * 64 + 30 * 3 * 16 * 2)


def test_specials_fp8_matches_torch_rounding() -> None:
    """Ties, subnormals and the largest values round exactly as torch's e4m3 conversion."""
    steps = np.float32(2.0) ** np.arange(-12, 9, dtype=np.float32)
    fractions = np.linspace(1, 2, 33, dtype=np.float32)  # includes the halfway points
    values = np.concatenate([np.outer(steps, fractions).reshape(-1), [0, 448, 447.9, 2**-9]])
    values = np.concatenate([values, -values]).astype(np.float32)
    ops = __import__("kvoffload.compression.lossy", fromlist=["_NUMPY"])
    ours = ops._NUMPY.to_fp8(values.clip(-448, 448))
    theirs = torch.from_numpy(values.clip(-448, 448)).to(torch.float8_e4m3fn).view(torch.uint8)
    assert np.array_equal(ours, theirs.numpy())


@pytest.mark.parametrize("name", ["fp8", "int4"])
def test_bad_input_is_a_codec_error(name: str) -> None:
    codec = get_codec(name)
    raw = make_kv_block("bfloat16", SPEC.shape or (), seed=5)
    with pytest.raises(CodecMismatchError, match="needs their shape"):
        codec.encode(raw, BlockSpec("bfloat16"))
    with pytest.raises(CodecMismatchError, match="not one block"):
        codec.encode(raw[:-2], SPEC)
    with pytest.raises(UnsupportedCodecConfigError, match="not uint8"):
        codec.encode(raw, BlockSpec.kv("uint8", 3, 2, 32, 128))
    nan = raw.copy()
    nan.view("<u2")[7] = 0x7FC0  # a bfloat16 NaN
    with pytest.raises(UnsupportedCodecConfigError, match="NaN|finite"):
        codec.encode(nan, SPEC)
    payload = as_payload(codec.encode(raw, SPEC))
    with pytest.raises(CorruptEncodedError):
        codec.decode(payload[:-1])
    with pytest.raises(CodecMismatchError):
        codec.decode_into(payload, np.empty(raw.size + 2, np.uint8))
    other = get_codec("int4" if name == "fp8" else "fp8")
    with pytest.raises(CorruptEncodedError, match=f"not a {other.name} block|needs"):
        other.decode(payload)


def test_int4_refuses_values_beyond_float16() -> None:
    spec = BlockSpec.kv("float32", 1, 1, 4, 4)
    raw = np.full(32, 1e6, np.float32).view(np.uint8)
    with pytest.raises(UnsupportedCodecConfigError, match="float16"):
        get_codec("int4").encode(raw, spec)
    assert get_codec("fp8").decode(get_codec("fp8").encode(raw, spec)).view(np.float32)[0] == 1e6


@pytest.mark.parametrize("name", ["fp8", "int4"])
@given(
    block=kv_blocks(),
    edits=st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_any_damaged_payload_decodes_or_raises_a_codec_error(
    name: str, block: tuple[np.ndarray, BlockSpec], edits: list[tuple[int, int]]
) -> None:
    raw, spec = block
    payload = bytearray(bytes(get_codec(name).encode(raw, spec)))
    for position, flip in edits:
        payload[position % len(payload)] ^= flip
    with contextlib.suppress(CodecError):
        get_codec(name, backend="numpy").decode(payload, limit=2 * raw.size)
