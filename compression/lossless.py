"""Lossless codecs: `none`, `lz4`, `zstd` on the raw bytes and `split-lz4`, `split-zstd` on
byte planes.

Why planes: in a bf16 value the high byte holds the sign and seven exponent bits and the low
byte one exponent bit and seven mantissa bits. KV exponents take few values (order-0 entropy
about 3 bits on SmolLM2) while mantissa bytes are close to random (7.96 bits). Interleaved,
neither an LZ coder nor zstd's Huffman stage sees the skew; split into planes, the exponent plane
shrinks to ~40% and the mantissa plane is stored as it is. fp16 and fp32 split the same way (2
and 4 planes).

When the block spec carries the KV shape, planes are ordered channel-major within K and within V
(``[k/v][layer][kv head][head dim][token]``): a channel's exponent changes little from token to
token (KIVI's observation that keys have per-channel outliers), and K and V, whose exponent
distributions differ, become separate zstd frames with their own Huffman tables. On real
SmolLM2 bf16 KV this is worth ~1.47x against 1.42x for token order.

Payload after the preamble (param = plane count):

====== =================================================================================
bytes  field
====== =================================================================================
4      part count P
4      part size: layers per part (LKHTD) or elements per part (flat)
4·P·N  stored length of each segment (part-major, plane-minor), N = plane count
P·N    method of each segment: 0 = stored raw, 1 = compressed
...    tail: raw length mod N bytes, stored as they are
...    the segments, in table order
====== =================================================================================

A *part* is a slice of elements (a range of layers of K or of V, or a range of flat elements);
each part's planes are compressed independently, which is what lets several threads encode or
decode one large block. A segment is kept compressed only if that saves at least 1/16 of it, so
incompressible mantissa planes cost nothing to decode.
"""

from __future__ import annotations

import itertools
import math
import struct
import threading
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

import lz4.block
import numpy as np
import zstandard

from kvoffload.compression.base import (
    PREAMBLE_BYTES,
    BlockSpec,
    Bytes,
    Codec,
    Encoded,
    Preamble,
    check_out,
)
from kvoffload.errors import CodecMismatchError, CorruptEncodedError, UnsupportedCodecConfigError

__all__ = [
    "Lz4Codec",
    "NoneCodec",
    "PlaneCodec",
    "SplitLz4Codec",
    "SplitZstdCodec",
    "ZstdCodec",
]

_R = TypeVar("_R")
_COUNTS = struct.Struct("<II")
_RAW, _PACKED = 0, 1
# Planes are split for these element sizes; other dtypes (fp8, int8, bytes) are one plane.
_SPLIT_SIZES = (2, 4)
_WORDS = {n: np.dtype(f"<u{n}") for n in _SPLIT_SIZES}
DEFAULT_PART_BYTES = 128 << 10


class NoneCodec(Codec):
    """The identity: the payload is the raw bytes, with no preamble."""

    name = "none"
    codec_id = 0
    lossless = True

    def encode(self, data: Bytes, spec: BlockSpec | None = None) -> Encoded:
        return data

    def decode_into(self, payload: Bytes, out: Bytes) -> None:
        check_out(out.size, payload.size)
        out[:] = payload

    def raw_length(self, payload: Bytes) -> int:
        return payload.size


class _Backend(Protocol):
    def compress(self, data: Bytes) -> bytes: ...

    def decompress(self, data: Bytes, size: int) -> bytes: ...


class _Zstd:
    """zstd frames. Compressor objects are not thread-safe, so each thread keeps its own."""

    def __init__(self, params: zstandard.ZstdCompressionParameters) -> None:
        self._params = params
        self._local = threading.local()

    def _pair(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        pair: tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor] | None = getattr(
            self._local, "pair", None
        )
        if pair is None:
            pair = (
                zstandard.ZstdCompressor(compression_params=self._params),
                zstandard.ZstdDecompressor(),
            )
            self._local.pair = pair
        return pair

    def compress(self, data: Bytes) -> bytes:
        return self._pair()[0].compress(data.data)

    def decompress(self, data: Bytes, size: int) -> bytes:
        try:
            # zstandard allocates whatever size a frame header declares and ignores
            # max_output_size then: a 47-byte frame could ask for a terabyte. Check first.
            declared = zstandard.frame_content_size(data.data)
            if declared not in (-1, size):
                raise CorruptEncodedError(f"zstd frame declares {declared} bytes, expected {size}")
            out: bytes = self._pair()[1].decompress(data.data, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise CorruptEncodedError(f"zstd: {exc}") from None
        return out


class _Lz4:
    """LZ4 block format (no frame header: sizes live in the segment table)."""

    def __init__(self, level: int | None) -> None:
        self._mode = "default" if level is None else "high_compression"
        self._level = 0 if level is None else level

    def compress(self, data: Bytes) -> bytes:
        packed: bytes = lz4.block.compress(
            data.data, mode=self._mode, compression=self._level, store_size=False
        )
        return packed

    def decompress(self, data: Bytes, size: int) -> bytes:
        try:
            out: bytes = lz4.block.decompress(data.data, uncompressed_size=size)
        except lz4.block.LZ4BlockError as exc:
            raise CorruptEncodedError(f"lz4: {exc}") from None
        return out


def _zstd_params(level: int | None) -> zstandard.ZstdCompressionParameters:
    if level is not None:
        return zstandard.ZstdCompressionParameters.from_level(level, write_checksum=False)
    # Exponent planes are almost all Huffman-coded literals; short matches only cost bits.
    # Measured on SmolLM2 bf16 KV: zstd-1 params give 1.454x at 0.64 GB/s encode, these give
    # 1.467x at 0.93 GB/s (the tiny hash table finds only long, cheap matches).
    return zstandard.ZstdCompressionParameters(
        window_log=17,
        chain_log=6,
        hash_log=6,
        search_log=1,
        min_match=7,
        target_length=0,
        strategy=zstandard.STRATEGY_FAST,
        write_checksum=False,
    )


@dataclass(frozen=True, slots=True)
class _Part:
    """A slice of the block's elements: `view` in natural order (last axis = byte of element);
    `keys` parts store their planes channel-major (token and head-dim axes swapped)."""

    view: Bytes
    keys: bool = False

    def plane(self, p: int) -> Bytes:
        """Plane `p` of this part in stored order, as a new contiguous flat array."""
        plane = self.view[..., p]
        return np.ascontiguousarray(plane.transpose(0, 1, 3, 2) if self.keys else plane).reshape(-1)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        shape = self.view.shape[:-1]
        return (*shape[:2], shape[3], shape[2]) if self.keys else shape

    def natural(self, plane: Bytes) -> Bytes:
        """A stored-order plane (or word array) viewed in natural order."""
        stored = plane.reshape(self.stored_shape)
        return stored.transpose(0, 1, 3, 2) if self.keys else stored


def _part_count(spec: BlockSpec, elements: int, part_size: int) -> int:
    """How many parts `_parts` cuts a block into."""
    if spec.shape is None:
        return -(-elements // part_size)
    return 2 * -(-spec.shape[0] // part_size)


def _parts(x: Bytes, spec: BlockSpec, part_size: int) -> list[_Part]:
    """Cut `x` (the block's elements as bytes) into parts of `part_size` elements (flat) or
    layers (LKHTD; K and V never share a part)."""
    n = spec.itemsize
    if spec.shape is None:
        flat = x.reshape(-1, n)
        return [_Part(flat[i : i + part_size]) for i in range(0, flat.shape[0], part_size)]
    kv = x.reshape(*spec.shape, n)
    layers = spec.shape[0]
    return [
        # Keys channel-major: a channel's exponent changes little from token to token (the
        # per-channel outliers KIVI quantises by); values vary per token, so they stay in
        # token order, which also keeps their decode a straight copy.
        _Part(kv[i : i + part_size, k_or_v], keys=k_or_v == 0)
        for k_or_v in (0, 1)
        for i in range(0, layers, part_size)
    ]


def _merge_planes(planes: list[Bytes], part: _Part) -> None:
    """Interleave stored-order byte planes into the part's natural-order view, in place.

    Token-order parts are built as whole words (shift, or), which vectorises; channel-major
    (key) parts are written plane by plane through the transposing view, which costs about
    as much as building words in a scratch array and transposing them, without the scratch:
    the decompressor's output stays the only intermediate buffer.
    """
    n = len(planes)
    if n == 1 or part.keys:
        for p, plane in enumerate(planes):
            part.view[..., p] = part.natural(plane)
        return
    word = _WORDS[n]
    dst = part.view.view(word)[..., 0]
    np.left_shift(planes[-1].reshape(dst.shape), 8 * (n - 1), out=dst, dtype=word)
    for p in range(n - 2, 0, -1):
        dst |= np.left_shift(planes[p].reshape(dst.shape), 8 * p, dtype=word)
    np.bitwise_or(dst, planes[0].reshape(dst.shape), out=dst, dtype=word)


class PlaneCodec(Codec):
    """Byte planes (or the raw bytes when `split` is false), each part compressed on its own.

    Args:
        level: backend level; None uses the codec's default (zstd-1 for `zstd`, parameters
            tuned for exponent planes for `split-zstd`, LZ4's fast mode).
        threads: worker threads for one block with several parts (blocks over
            `part_bytes`); zstd and lz4 release the GIL, so parts run in parallel.
        part_bytes: bytes per plane segment; a part never holds less than one layer of K or V.
    """

    lossless = True
    split: ClassVar[bool]

    def __init__(
        self, *, level: int | None = None, threads: int = 1, part_bytes: int = DEFAULT_PART_BYTES
    ) -> None:
        if threads < 1 or part_bytes < 1:
            raise UnsupportedCodecConfigError("threads and part_bytes must be positive")
        self.level = level
        self.threads = threads
        self.part_bytes = part_bytes
        self._backend = self._make_backend(level)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @abstractmethod
    def _make_backend(self, level: int | None) -> _Backend:
        """The byte compressor this codec uses at `level`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(level={self.level}, threads={self.threads})"

    # ----------------------------------------------------------------- layout

    def _layout(self, size: int, spec: BlockSpec | None) -> BlockSpec:
        """The element view this codec uses for `size` raw bytes described by `spec`."""
        if not self.split or spec is None or spec.itemsize not in _SPLIT_SIZES:
            return BlockSpec("uint8")
        if spec.shape is not None and spec.nbytes != size:
            raise CodecMismatchError(
                f"value of {size} bytes is not one block of shape {spec.shape} "
                f"({spec.nbytes} bytes of {spec.dtype})"
            )
        return spec

    def _part_size(self, spec: BlockSpec) -> int:
        if spec.shape is None:
            return max(1, self.part_bytes)
        _, _, heads, tokens, dim = spec.shape
        return max(1, self.part_bytes // (heads * tokens * dim))

    def _map(self, fn: Callable[[int], _R], count: int) -> list[_R]:
        """`fn` over part indices, on the pool when this block has several parts."""
        if self.threads == 1 or count <= 1:
            return [fn(i) for i in range(count)]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvoffload-codec")
        return list(self._pool.map(fn, range(count)))

    # ----------------------------------------------------------------- encode

    def encode(self, data: Bytes, spec: BlockSpec | None = None) -> Encoded:
        layout = self._layout(data.size, spec)
        n = layout.itemsize
        body = data.size - data.size % n
        part_size = self._part_size(layout)
        parts = _parts(data[:body], layout, part_size)

        def encode_part(index: int) -> list[tuple[int, bytes | Bytes]]:
            out: list[tuple[int, bytes | Bytes]] = []
            for p in range(n):
                plane = parts[index].plane(p)
                # The low half of each element's bytes is mantissa, close to random: not worth
                # trying. Elsewhere keep compression only where it pays for its decode time.
                packed = self._backend.compress(plane) if p >= n // 2 else None
                if packed is not None and len(packed) <= plane.size - plane.size // 16:
                    out.append((_PACKED, packed))
                else:
                    out.append((_RAW, plane))
            return out

        segments = [seg for encoded in self._map(encode_part, len(parts)) for seg in encoded]
        table = (
            _COUNTS.pack(len(parts), part_size)
            + np.asarray([len(s) for _, s in segments], "<u4").tobytes()
            + bytes(m for m, _ in segments)
        )
        head = Preamble(layout, data.size, n).pack()
        chunks = [s if isinstance(s, bytes) else s.data for _, s in segments]
        return b"".join([head, table, data[body:].tobytes(), *chunks])

    # ----------------------------------------------------------------- decode

    def raw_length(self, payload: Bytes) -> int:
        return Preamble.unpack(payload).raw_length

    def decode_into(self, payload: Bytes, out: Bytes) -> None:
        head = Preamble.unpack(payload)
        check_out(out.size, head.raw_length)
        spec, n = head.spec, head.param
        if n != spec.itemsize or (n > 1 and not self.split):
            raise CorruptEncodedError(f"{n} planes do not fit a {self.name} payload of {spec}")
        body = head.raw_length - head.raw_length % n
        pos = PREAMBLE_BYTES
        if payload.size < pos + _COUNTS.size:
            raise CorruptEncodedError("payload ends inside its segment table")
        n_parts, part_size = _COUNTS.unpack_from(payload.data, pos)
        pos += _COUNTS.size
        if part_size == 0:
            raise CorruptEncodedError("payload declares empty parts")
        # Counted before the parts are built, so a damaged part size cannot make millions.
        expected = _part_count(spec, body // n, part_size)
        if n_parts != expected:
            raise CorruptEncodedError(
                f"payload declares {n_parts} parts, its layout has {expected}"
            )
        n_seg = n_parts * n
        table_end = pos + 5 * n_seg
        # Every part costs 5 table bytes per plane: a tiny payload cannot claim many parts.
        if payload.size < table_end:
            raise CorruptEncodedError("payload ends inside its segment table")
        parts = _parts(out[:body], spec, part_size)
        lengths = struct.unpack_from(f"<{n_seg}I", payload.data, pos)
        methods = payload[pos + 4 * n_seg : table_end].tobytes()
        tail = head.raw_length - body
        starts = list(itertools.accumulate(lengths, initial=table_end + tail))
        if starts[-1] != payload.size or any(m > _PACKED for m in methods):
            raise CorruptEncodedError(
                f"segment table accounts for {starts[-1]} bytes, payload holds {payload.size}"
            )
        out[body:] = payload[table_end : table_end + tail]

        def decode_part(index: int) -> None:
            part = parts[index]
            size = math.prod(part.stored_shape)
            planes = []
            for p in range(n):
                s = index * n + p
                src = payload[starts[s] : starts[s + 1]]
                if methods[s] == _PACKED:
                    plane = np.frombuffer(self._backend.decompress(src, size), dtype=np.uint8)
                else:
                    plane = src
                if plane.size != size:
                    raise CorruptEncodedError(
                        f"segment {s} decodes to {plane.size} bytes, expected {size}"
                    )
                planes.append(plane)
            _merge_planes(planes, part)

        self._map(decode_part, len(parts))


class Lz4Codec(PlaneCodec):
    """LZ4 on the raw bytes: the fastest codec, little gain on floating-point KV."""

    name = "lz4"
    codec_id = 1
    split = False

    def _make_backend(self, level: int | None) -> _Backend:
        return _Lz4(level)


class ZstdCodec(PlaneCodec):
    """zstd on the raw bytes (level 1 unless told otherwise)."""

    name = "zstd"
    codec_id = 2
    split = False

    def _make_backend(self, level: int | None) -> _Backend:
        return _Zstd(_zstd_params(1 if level is None else level))


class SplitLz4Codec(PlaneCodec):
    """Byte planes, then LZ4: fast, but LZ4 has no entropy stage to exploit the skew."""

    name = "split-lz4"
    codec_id = 3
    split = True
    typed = True

    def _make_backend(self, level: int | None) -> _Backend:
        return _Lz4(level)


class SplitZstdCodec(PlaneCodec):
    """Byte planes, then zstd with parameters tuned for exponent planes: the KV codec."""

    name = "split-zstd"
    codec_id = 4
    split = True
    typed = True

    def _make_backend(self, level: int | None) -> _Backend:
        return _Zstd(_zstd_params(level))
