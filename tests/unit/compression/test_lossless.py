"""Lossless codecs: bit-exact round trips (hypothesis), the parallel path, bad payloads."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvdata import make_kv_block

from kvoffload.compression import (
    PREAMBLE_BYTES,
    BlockSpec,
    CodecError,
    CodecMismatchError,
    CorruptEncodedError,
    as_payload,
    codec_for_id,
    get_codec,
)

LOSSLESS = ["none", "lz4", "zstd", "split-lz4", "split-zstd"]
DTYPES = ["uint8", "bfloat16", "float16", "float32"]


@st.composite
def blocks(draw: st.DrawFn) -> tuple[np.ndarray, BlockSpec | None]:
    """Raw bytes plus the spec a client would pass: KV-shaped, flat with a dtype, or none."""
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["kv", "flat", "bytes"]))
    if kind == "kv":
        dims = draw(st.tuples(*(st.integers(1, 5),) * 3, st.integers(1, 33)))
        layers, heads, tokens, dim = dims
        spec = BlockSpec.kv(dtype, layers, heads, tokens, dim)
        return make_kv_block(dtype, (layers, 2, heads, tokens, dim), seed), spec
    values = draw(st.integers(0, 40_000))
    raw = make_kv_block(dtype, (values,), seed)
    # An odd tail byte tests lengths that are not whole elements.
    if draw(st.booleans()):
        raw = np.concatenate([raw, np.array([seed & 0xFF], dtype=np.uint8)])
    return raw, (BlockSpec(dtype) if kind == "flat" else None)


def _decode(name: str, encoded: object, limit: int | None = None) -> np.ndarray:
    # Readers use the default instance found by id, whatever options the writer had.
    codec = codec_for_id(get_codec(name).codec_id)
    return codec.decode(encoded, limit=limit)


@pytest.mark.parametrize("name", LOSSLESS)
@given(block=blocks())
def test_round_trip_is_bit_exact(name: str, block: tuple[np.ndarray, BlockSpec | None]) -> None:
    raw, spec = block
    encoded = get_codec(name).encode(raw, spec)
    assert np.array_equal(_decode(name, encoded), raw)


@pytest.mark.parametrize("name", ["lz4", "zstd", "split-lz4", "split-zstd"])
@given(block=blocks(), threads=st.integers(2, 4), part_bytes=st.sampled_from([7, 512, 4096]))
def test_parallel_path_writes_the_same_payload(
    name: str, block: tuple[np.ndarray, BlockSpec | None], threads: int, part_bytes: int
) -> None:
    raw, spec = block
    serial = get_codec(name, part_bytes=part_bytes).encode(raw, spec)
    parallel = get_codec(name, threads=threads, part_bytes=part_bytes)
    encoded = parallel.encode(raw, spec)
    assert bytes(encoded) == bytes(serial)
    out = np.empty_like(raw)
    parallel.decode_into(as_payload(encoded), out)  # decoding on the pool too
    assert np.array_equal(out, raw)


def _ratio(name: str, raw: np.ndarray, spec: BlockSpec) -> float:
    return raw.size / len(get_codec(name).encode(raw, spec))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_byte_planes_beat_plain_zstd_on_float_kv(dtype: str) -> None:
    spec = BlockSpec.kv(dtype, 8, 2, 16, 64)
    raw = make_kv_block(dtype, spec.shape or (), seed=1)
    split = _ratio("split-zstd", raw, spec)
    assert split > 1.1 and split > _ratio("zstd", raw, spec)
    if dtype != "float16":
        # fp16's high byte mixes 5 exponent bits with 2 mantissa bits: without an entropy
        # stage LZ4 finds nothing to match, split or not.
        assert _ratio("split-lz4", raw, spec) > _ratio("lz4", raw, spec)


def test_incompressible_planes_are_stored_raw() -> None:
    raw = make_kv_block("uint8", (300_000,), seed=2)
    for name in ("zstd", "split-zstd", "lz4"):
        encoded = get_codec(name).encode(raw, BlockSpec("bfloat16"))
        # Raw segments cost only the preamble and the table (5 bytes a segment).
        assert len(encoded) <= raw.size + PREAMBLE_BYTES + 8 + 5 * 64


def test_a_large_block_is_cut_into_parts_and_still_round_trips() -> None:
    spec = BlockSpec.kv("bfloat16", 64, 8, 16, 128)  # 4 MiB: 8 parts of 8 layers at 128 KiB
    raw = make_kv_block("bfloat16", spec.shape or (), seed=3)
    codec = get_codec("split-zstd", threads=2)
    assert np.array_equal(codec.decode(codec.encode(raw, spec)), raw)


def test_spec_and_data_must_agree() -> None:
    spec = BlockSpec.kv("bfloat16", 2, 1, 4, 8)
    with pytest.raises(CodecMismatchError, match="not one block"):
        get_codec("split-zstd").encode(np.zeros(10, np.uint8), spec)
    payload = as_payload(get_codec("zstd").encode(np.zeros(100, np.uint8)))
    with pytest.raises(CodecMismatchError, match="decodes to 100"):
        get_codec("zstd").decode_into(payload, np.zeros(99, np.uint8))


@pytest.mark.parametrize("name", ["lz4", "zstd", "split-lz4", "split-zstd"])
@given(block=blocks(), cut=st.integers(1, 10_000))
def test_a_truncated_payload_is_a_codec_error(
    name: str, block: tuple[np.ndarray, BlockSpec | None], cut: int
) -> None:
    raw, spec = block
    payload = as_payload(get_codec(name).encode(raw, spec))
    with pytest.raises(CorruptEncodedError):
        _decode(name, payload[: max(0, payload.size - cut)])


@pytest.mark.parametrize("name", ["lz4", "zstd", "split-lz4", "split-zstd"])
@given(
    block=blocks(),
    edits=st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_any_damaged_payload_decodes_or_raises_a_codec_error(
    name: str, block: tuple[np.ndarray, BlockSpec | None], edits: list[tuple[int, int]]
) -> None:
    """Fuzz invariant: whatever the bytes, decoding returns or raises CodecError, nothing else
    (the block checksum, one layer up, is what stops damaged bytes from being used)."""
    raw, spec = block
    payload = bytearray(bytes(get_codec(name).encode(raw, spec)))
    for position, flip in edits:
        payload[position % len(payload)] ^= flip
    with contextlib.suppress(CodecError):
        _decode(name, payload, limit=2 * raw.size + 64)


def test_payload_of_another_codec_is_rejected() -> None:
    raw = make_kv_block("bfloat16", (2, 2, 1, 4, 8), seed=4)
    spec = BlockSpec.kv("bfloat16", 2, 1, 4, 8)
    split = get_codec("split-zstd").encode(raw, spec)
    with pytest.raises(CorruptEncodedError, match="planes"):
        get_codec("zstd").decode(split)
    with pytest.raises(CorruptEncodedError):
        get_codec("fp8").decode(split)
