"""The codec interface, the block spec codecs may rely on, and the preamble of every payload.

A codec turns one block's raw bytes into a payload and back. Every payload except the identity
codec's starts with a fixed 28-byte little-endian *preamble* that records what decoding needs
(format version, element dtype, layout, KV dims, raw length), so a payload decodes without the
namespace that wrote it and a reader never has to guess:

====== ===== ==========================================================
offset bytes field
====== ===== ==========================================================
0      1     payload format version (1)
1      1     dtype code (`DTYPE_CODES`)
2      1     layout: 0 = flat bytes, 1 = LKHTD (layer, k/v, kv head, token, head dim)
3      1     codec parameter (plane count, quantisation group size, ...)
4      8     raw length in bytes
12     16    LKHTD dims as four u32: layers, kv heads, tokens, head dim (zeros when flat)
====== ===== ==========================================================
"""

from __future__ import annotations

import math
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from kvoffload.errors import (
    CodecMismatchError,
    CorruptEncodedError,
    UnsupportedCodecConfigError,
)

__all__ = [
    "DTYPE_BYTES",
    "DTYPE_CODES",
    "LAYOUT_FLAT",
    "LAYOUT_LKHTD",
    "PREAMBLE_BYTES",
    "BlockSpec",
    "Bytes",
    "Codec",
    "Encoded",
    "Preamble",
    "as_payload",
]

# Largest raw length `Codec.decode` accepts unless told otherwise.
_DECODE_LIMIT = 1 << 32

Bytes = npt.NDArray[np.uint8]
# What `Codec.encode` returns: a flat uint8 array or bytes, ready to hand to a transport.
Encoded = bytes | Bytes

# Element types of KV blocks: name -> (code stored in payloads, bytes per element).
_DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (0, 1),  # untyped bytes
    "bfloat16": (1, 2),
    "float16": (2, 2),
    "float32": (3, 4),
    "float8_e4m3fn": (4, 1),
    "float8_e5m2": (5, 1),
    "int8": (6, 1),
}
DTYPE_BYTES = {name: size for name, (_, size) in _DTYPES.items()}
DTYPE_CODES = {name: code for name, (code, _) in _DTYPES.items()}
_DTYPE_BY_CODE = {code: name for name, code in DTYPE_CODES.items()}

LAYOUT_FLAT = 0
LAYOUT_LKHTD = 1

_PREAMBLE = struct.Struct("<BBBBQ4I")
PREAMBLE_BYTES = _PREAMBLE.size  # 28
_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """What a codec may know about a block: its element dtype and, when known, its KV shape.

    `shape` is ``(layers, 2, kv heads, tokens, head dim)``, the "LKHTD" layout of a namespace.
    Byte-level codecs need neither; byte-plane codecs use the dtype (and the shape to order
    planes by channel); quantising codecs need both.
    """

    dtype: str = "uint8"
    shape: tuple[int, int, int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise UnsupportedCodecConfigError(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}"
            )
        if self.shape is not None and (
            len(self.shape) != 5 or self.shape[1] != 2 or min(self.shape) <= 0
        ):
            raise CodecMismatchError(
                f"a KV block shape is (layers, 2, kv heads, tokens, head dim), got {self.shape}"
            )

    @classmethod
    def kv(cls, dtype: str, layers: int, kv_heads: int, tokens: int, head_dim: int) -> BlockSpec:
        """The spec of one LKHTD block."""
        return cls(dtype, (layers, 2, kv_heads, tokens, head_dim))

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int | None:
        """Raw bytes of one block of this shape (None when the shape is unknown)."""
        if self.shape is None:
            return None
        return math.prod(self.shape) * self.itemsize

    def flat(self) -> BlockSpec:
        """The same dtype without a shape."""
        return BlockSpec(self.dtype)


@dataclass(frozen=True, slots=True)
class Preamble:
    """The fixed head of every encoded payload; see the module docstring."""

    spec: BlockSpec
    raw_length: int
    param: int = 0

    def pack(self) -> bytes:
        shape = self.spec.shape
        dims = (shape[0], shape[2], shape[3], shape[4]) if shape is not None else (0, 0, 0, 0)
        if max(dims) >= 2**32 or not 0 <= self.param < 256:
            raise UnsupportedCodecConfigError(f"block dims {dims} too large to encode")
        layout = LAYOUT_FLAT if shape is None else LAYOUT_LKHTD
        return _PREAMBLE.pack(
            _FORMAT_VERSION,
            DTYPE_CODES[self.spec.dtype],
            layout,
            self.param,
            self.raw_length,
            *dims,
        )

    @classmethod
    def unpack(cls, payload: Bytes) -> Preamble:
        """Parse the preamble at the start of `payload`.

        Raises:
            CorruptEncodedError: too short, unknown version, dtype or layout, bad dims.
        """
        if payload.size < PREAMBLE_BYTES:
            raise CorruptEncodedError(
                f"payload of {payload.size} bytes is shorter than a preamble ({PREAMBLE_BYTES})"
            )
        version, code, layout, param, raw_length, *dims = _PREAMBLE.unpack(
            payload[:PREAMBLE_BYTES].tobytes()
        )
        if version != _FORMAT_VERSION:
            raise CorruptEncodedError(f"unknown payload format version {version}")
        dtype = _DTYPE_BY_CODE.get(code)
        if dtype is None:
            raise CorruptEncodedError(f"unknown dtype code {code} in payload")
        if layout == LAYOUT_FLAT and not any(dims):
            return cls(BlockSpec(dtype), raw_length, param)
        if layout != LAYOUT_LKHTD or min(dims) == 0:
            raise CorruptEncodedError(f"bad payload layout {layout} with dims {dims}")
        layers, heads, tokens, head_dim = dims
        spec = BlockSpec.kv(dtype, layers, heads, tokens, head_dim)
        if spec.nbytes != raw_length:
            raise CorruptEncodedError(
                f"payload dims {dims} ({spec.nbytes} bytes) disagree with its raw length "
                f"{raw_length}"
            )
        return cls(spec, raw_length, param)


def as_payload(payload: object) -> Bytes:
    """A flat uint8 view of an encoded payload (bytes, memoryview or uint8 array), no copy."""
    try:
        return np.frombuffer(payload, dtype=np.uint8)  # type: ignore[call-overload,no-any-return]
    except (TypeError, ValueError) as exc:
        raise CodecMismatchError(f"a payload must be a contiguous byte buffer: {exc}") from None


class Codec(ABC):
    """Encodes one block's raw bytes into a payload and decodes a payload into a buffer.

    Subclasses set `name` (registry name), `codec_id` (stored in every block header, never
    reused) and `lossless`. Instances hold only encoder options (level, threads): any
    instance of a codec decodes any payload of that codec. Instances are safe to share between
    threads.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    lossless: ClassVar[bool]
    # Whether `encode` reads elements (needs the spec's dtype) rather than plain bytes.
    typed: ClassVar[bool] = False

    @abstractmethod
    def encode(self, data: Bytes, spec: BlockSpec | None = None) -> Encoded:
        """The payload for the raw bytes `data` (a flat uint8 array).

        Raises:
            CodecMismatchError: `data` does not fit `spec` (size, or a spec the codec needs).
            UnsupportedCodecConfigError: the codec cannot encode this dtype.
        """

    @abstractmethod
    def decode_into(self, payload: Bytes, out: Bytes) -> None:
        """Decode `payload` into `out`, a writable flat uint8 array of exactly its raw length.

        Raises:
            CorruptEncodedError: the payload is malformed. `out` may then be partly written.
            CodecMismatchError: `out` is not the payload's raw length.
        """

    @abstractmethod
    def raw_length(self, payload: Bytes) -> int:
        """The decoded size of `payload`, read from its preamble.

        Raises:
            CorruptEncodedError: the payload is malformed.
        """

    def decode(self, payload: object, *, limit: int | None = None) -> Bytes:
        """Decode `payload` (any contiguous byte buffer) into a new uint8 array.

        Args:
            limit: the largest raw length to accept (default 4 GiB). The length comes from the
                payload, so bound it when the payload is not trusted (the SDK bounds it by the
                store's largest value and verifies a checksum first).

        Raises:
            CorruptEncodedError: the payload is malformed or decodes to more than `limit`.
        """
        view = as_payload(payload)
        length = self.raw_length(view)
        limit = _DECODE_LIMIT if limit is None else limit
        if length > limit:
            raise CorruptEncodedError(f"payload claims {length} raw bytes, over the limit {limit}")
        out = np.empty(length, dtype=np.uint8)
        self.decode_into(view, out)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_out(out_length: int, raw_length: int) -> None:
    """An output must be exactly the decoded size (callers trim larger buffers)."""
    if out_length != raw_length:
        raise CodecMismatchError(
            f"output buffer holds {out_length} bytes but the payload decodes to {raw_length}"
        )
