"""Lossy codecs for LKHTD KV blocks: `fp8` (e4m3) and `int4` (KIVI-style groups).

Both quantise in float32 and write their scales into the payload, so a payload decodes on its
own. Each algorithm is written once over a small set of array operations (`_Ops`) with a numpy
and a torch implementation: `encode`/`decode_into` (host buffers, the SDK's path) run on numpy
and need no torch; `encode_tensor`/`decode_tensor` run the same steps in torch on whatever
device the tensor lives on (CPU here, CUDA unchanged), so a connector can quantise on the GPU
before the copy to the host. Both paths produce the same bytes (tests compare them).

`fp8` payload after the preamble: float32 scales ``[layer][k/v][kv head]``, then one e4m3 byte
per element in LKHTD order. A scale is the head's absolute maximum over the block / 448 (the
largest e4m3 value), so nothing saturates.

`int4` payload after the preamble (param = group size G, 32): float16 zero points and scales of
the keys ``[layer][head][token group][dim]`` (per channel, groups of G tokens), then of the
values ``[layer][head][token][dim group]`` (per token, groups of G channels), then the 4-bit
codes of keys and of values in LKHTD order, two per byte, low nibble first. A group is the
largest divisor of the axis not above G. Asymmetric: ``x ≈ q · scale + zero`` with
``q ∈ [0, 15]``, ``scale = (max − min) / 15``; scale and zero are rounded to float16 before
quantising, so the codes are computed against exactly what the decoder will use.
"""

from __future__ import annotations

import importlib
import math
import sys
from abc import abstractmethod
from typing import Any

import numpy as np

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

__all__ = ["Fp8Codec", "Int4Codec", "QuantCodec"]

_FLOATS = ("bfloat16", "float16", "float32")
FP8_MAX = 448.0
# Largest finite value of each dtype a quantised block can be decoded into.
_DTYPE_MAX = {"float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38,
              "float16": 65504.0}  # fmt: skip
INT4_GROUP = 32


# ---------------------------------------------------------------------------- array operations
#
# Arrays are `Any` here: numpy arrays in one implementation, torch tensors in the other.


def _fp8_table() -> np.ndarray:
    """float32 value of every e4m3fn code (0x7F/0xFF are NaN; the encoder never emits them)."""
    codes = np.arange(256)
    exp, man = (codes >> 3) & 0xF, (codes & 7).astype(np.float32)
    value = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    value = np.where(codes & 0x80, -value, value).astype(np.float32)
    value[[0x7F, 0xFF]] = np.nan
    return value


class _Ops:
    """The operations the quantisers use, in numpy. `_TorchOps` overrides them for torch."""

    _FP8 = _fp8_table()

    def from_host(self, data: bytes, like: Any) -> Any:
        return np.frombuffer(data, dtype=np.uint8)

    def cat(self, parts: list[Any]) -> Any:
        return np.concatenate(parts)

    def to_host(self, data: Any) -> bytes:
        return bytes(data.tobytes())

    def load(self, raw: Any, dtype: str, shape: tuple[int, ...]) -> Any:
        """float32 values of `raw` (flat uint8) read as `dtype`."""
        if dtype == "bfloat16":
            bits = raw.view("<u2").astype(np.uint32) << 16
            return bits.view(np.float32).reshape(shape)
        return raw.view("<f2" if dtype == "float16" else "<f4").astype(np.float32).reshape(shape)

    def store(self, x: Any, dtype: str, out: Any) -> None:
        """Round float32 `x` to `dtype` (nearest even) into `out` (flat uint8)."""
        if dtype == "bfloat16":
            bits = x.reshape(-1).view(np.uint32)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            out.view("<u2")[:] = rounded
        else:
            # Only a damaged payload can overflow float16 here; its checksum stops it first.
            with np.errstate(over="ignore"):
                out.view("<f2" if dtype == "float16" else "<f4")[:] = x.reshape(-1)

    def amax(self, x: Any, axes: tuple[int, ...], keepdims: bool = False) -> Any:
        return x.max(axis=axes, keepdims=keepdims)

    def amin(self, x: Any, axes: tuple[int, ...], keepdims: bool = False) -> Any:
        return x.min(axis=axes, keepdims=keepdims)

    def abs(self, x: Any) -> Any:
        return np.abs(x)

    def where(self, cond: Any, x: Any, other: float) -> Any:
        return np.where(cond, x, np.float32(other))

    def all_finite(self, x: Any) -> bool:
        return bool(np.isfinite(x).all())

    def all_nonnegative(self, x: Any) -> bool:
        return bool((x >= 0).all())

    def all_within(self, x: Any, limit: float) -> bool:
        return bool((np.abs(x) <= limit).all())

    def codes(self, x: Any, top: int) -> Any:
        """round-half-even(x) clipped to [0, top], as uint8."""
        return np.clip(np.rint(x), 0, top).astype(np.uint8)

    def via_half(self, x: Any) -> Any:
        return x.astype(np.float16).astype(np.float32)

    def half_bytes(self, x: Any) -> Any:
        return x.astype("<f2").reshape(-1).view(np.uint8)

    def from_half(self, raw: Any, shape: tuple[int, ...]) -> Any:
        return raw.view("<f2").astype(np.float32).reshape(shape)

    def f32_bytes(self, x: Any) -> Any:
        return np.ascontiguousarray(x, dtype="<f4").reshape(-1).view(np.uint8)

    def from_f32(self, raw: Any, shape: tuple[int, ...]) -> Any:
        return raw.view("<f4").reshape(shape)

    def to_fp8(self, x: Any) -> Any:
        """e4m3fn codes of float32 `x` (|x| ≤ 448), rounded to nearest even."""
        bits = np.ascontiguousarray(x, dtype=np.float32).reshape(-1).view(np.uint32)
        sign = (bits >> 24).astype(np.uint8) & 0x80
        magnitude = bits & 0x7FFFFFFF
        # Subnormals (|x| < 2^-6) are multiples of 2^-9; code 8 is the smallest normal.
        small = np.flatnonzero(magnitude < 0x3C800000)  # 2^-6
        small_codes = np.rint(magnitude[small].view(np.float32) * np.float32(512))
        # Normal numbers: round the mantissa to 3 bits (nearest even), then rebias the
        # exponent from 127 to 7; in place, as these arrays are the size of the block.
        lsb = (magnitude >> 20) & 1
        magnitude += 0x7FFFF
        magnitude += lsb
        magnitude >>= 20
        magnitude -= (127 - 7) << 3  # wraps for subnormals, which are overwritten below
        code = magnitude.astype(np.uint8)
        code[small] = small_codes.astype(np.uint8)
        code |= sign
        return code

    def from_fp8(self, codes: Any) -> Any:
        return self._FP8[codes]

    def pack4(self, q: Any) -> Any:
        """Two 4-bit codes per byte, low nibble first (`q` has an even length)."""
        return q[0::2] | (q[1::2] << 4)

    def unpack4(self, packed: Any) -> Any:
        return np.stack((packed & 15, packed >> 4), axis=-1).reshape(-1)

    def cat_kv(self, keys: Any, values: Any) -> Any:
        """Join K and V halves ``[layer, 1, ...]`` into ``[layer, 2, ...]``."""
        return np.concatenate((keys, values), axis=1)


class _TorchOps(_Ops):
    def __init__(self) -> None:
        self.torch: Any = importlib.import_module("torch")
        t = self.torch
        self._dtypes = {"bfloat16": t.bfloat16, "float16": t.float16, "float32": t.float32}

    def from_host(self, data: bytes, like: Any) -> Any:
        return self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8).to(like.device)

    def host_tensor(self, array: Bytes) -> Any:
        """A CPU tensor over a numpy byte array; read-only arrays are copied first, because
        torch cannot hold read-only memory (it would warn, and it may not be written)."""
        return self.torch.from_numpy(array if array.flags.writeable else array.copy())

    def cat(self, parts: list[Any]) -> Any:
        return self.torch.cat(parts)

    def to_host(self, data: Any) -> bytes:
        return bytes(data.cpu().numpy().tobytes())

    def load(self, raw: Any, dtype: str, shape: tuple[int, ...]) -> Any:
        return raw.view(self._dtypes[dtype]).float().reshape(shape)

    def store(self, x: Any, dtype: str, out: Any) -> None:
        out.view(self._dtypes[dtype]).copy_(x.reshape(-1))

    def amax(self, x: Any, axes: tuple[int, ...], keepdims: bool = False) -> Any:
        return x.amax(dim=axes, keepdim=keepdims)

    def amin(self, x: Any, axes: tuple[int, ...], keepdims: bool = False) -> Any:
        return x.amin(dim=axes, keepdim=keepdims)

    def abs(self, x: Any) -> Any:
        return x.abs()

    def where(self, cond: Any, x: Any, other: float) -> Any:
        return self.torch.where(cond, x, self.torch.tensor(other, dtype=x.dtype, device=x.device))

    def all_finite(self, x: Any) -> bool:
        return bool(self.torch.isfinite(x).all())

    def all_within(self, x: Any, limit: float) -> bool:
        return bool((x.abs() <= limit).all())

    def codes(self, x: Any, top: int) -> Any:
        return self.torch.round(x).clamp_(0, top).to(self.torch.uint8)

    def via_half(self, x: Any) -> Any:
        return x.half().float()

    def half_bytes(self, x: Any) -> Any:
        return x.half().contiguous().reshape(-1).view(self.torch.uint8)

    def from_half(self, raw: Any, shape: tuple[int, ...]) -> Any:
        return raw.view(self.torch.float16).float().reshape(shape)

    def f32_bytes(self, x: Any) -> Any:
        return x.float().contiguous().reshape(-1).view(self.torch.uint8)

    def from_f32(self, raw: Any, shape: tuple[int, ...]) -> Any:
        return raw.view(self.torch.float32).reshape(shape)

    def to_fp8(self, x: Any) -> Any:
        return x.reshape(-1).to(self.torch.float8_e4m3fn).view(self.torch.uint8)

    def from_fp8(self, codes: Any) -> Any:
        return codes.view(self.torch.float8_e4m3fn).float()

    def unpack4(self, packed: Any) -> Any:
        return self.torch.stack((packed & 15, packed >> 4), dim=-1).reshape(-1)

    def cat_kv(self, keys: Any, values: Any) -> Any:
        return self.torch.cat((keys, values), dim=1)


_NUMPY = _Ops()
_TORCH: list[_TorchOps] = []


def _torch_ops() -> _TorchOps:
    if not _TORCH:
        _TORCH.append(_TorchOps())
    return _TORCH[0]


def _loaded_torch() -> _TorchOps | None:
    """Torch operations if the process has already imported torch, else None.

    Host buffers use torch when it is there, so the path a GPU would run is the one
    exercised, but never import it: that would cost seconds in a process that does not use
    torch. Both produce the same bytes; on one CPU core torch encodes 1.2-1.6x faster and
    numpy decodes up to 1.3x faster (bench codecs reports both).
    """
    return _torch_ops() if "torch" in sys.modules else None


# ---------------------------------------------------------------------------- codecs


class QuantCodec(Codec):
    """Shared frame of the quantising codecs: spec checks, preamble, host and tensor entry points.

    Subclasses implement `_quantise` (float32 LKHTD values -> payload sections) and
    `_dequantise` (payload body -> float32 LKHTD values) over `_Ops`.
    """

    lossless = False
    typed = True
    param: int = 0

    def __init__(self, *, backend: str = "auto") -> None:
        """
        Args:
            backend: what `encode`/`decode_into` compute with: "numpy", "torch", or "auto"
                (torch when the process has already imported it, else numpy). The bytes are
                the same; only the speed differs.

        Raises:
            UnsupportedCodecConfigError: an unknown backend, or "torch" without torch.
        """
        if backend not in ("auto", "numpy", "torch"):
            raise UnsupportedCodecConfigError(
                f"unknown backend {backend!r}; valid: auto, numpy, torch"
            )
        if backend == "torch":
            try:
                _torch_ops()
            except ImportError:
                raise UnsupportedCodecConfigError("backend 'torch' needs torch installed") from None
        self.backend = backend

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r})"

    def _host_ops(self) -> _TorchOps | None:
        """Torch operations for host buffers, or None for numpy."""
        if self.backend == "numpy":
            return None
        return _loaded_torch() if self.backend == "auto" else _torch_ops()

    @abstractmethod
    def _quantise(self, ops: _Ops, x: Any) -> list[Any]:
        """Payload sections (flat uint8 arrays) for float32 values `x` of shape LKHTD."""

    @abstractmethod
    def _body_bytes(self, shape: tuple[int, int, int, int, int], param: int) -> int:
        """Payload bytes after the preamble for one block of `shape`."""

    @abstractmethod
    def _dequantise(self, ops: _Ops, body: Any, shape: tuple[int, int, int, int, int]) -> Any:
        """float32 LKHTD values from the payload body."""

    # ------------------------------------------------------------------ checks

    def _check_spec(self, size: int, spec: BlockSpec | None) -> tuple[int, int, int, int, int]:
        if spec is None or spec.shape is None:
            raise CodecMismatchError(
                f"codec {self.name!r} quantises KV blocks and needs their shape: use a client "
                "with a Namespace (or pass a BlockSpec with a shape)"
            )
        if spec.dtype not in _FLOATS:
            raise UnsupportedCodecConfigError(
                f"codec {self.name!r} quantises {', '.join(_FLOATS)}, not {spec.dtype}"
            )
        if size != spec.nbytes:
            raise CodecMismatchError(
                f"value of {size} bytes is not one block of shape {spec.shape} "
                f"({spec.nbytes} bytes of {spec.dtype})"
            )
        return spec.shape

    def _head(self, ops: _Ops, payload: Any) -> tuple[Preamble, Any]:
        """The preamble (read on the host) and the body of `payload`."""
        if payload.shape[0] < PREAMBLE_BYTES:
            raise CorruptEncodedError(f"payload of {payload.shape[0]} bytes has no preamble")
        head = Preamble.unpack(np.frombuffer(ops.to_host(payload[:PREAMBLE_BYTES]), np.uint8))
        shape = head.spec.shape
        if shape is None or head.spec.dtype not in _FLOATS or head.param != self.param:
            raise CorruptEncodedError(f"payload is not a {self.name} block ({head.spec})")
        expected = PREAMBLE_BYTES + self._body_bytes(shape, head.param)
        if payload.shape[0] != expected:
            raise CorruptEncodedError(
                f"{self.name} payload of {payload.shape[0]} bytes, its block needs {expected}"
            )
        return head, payload[PREAMBLE_BYTES:]

    # ------------------------------------------------------------------ both paths

    def _encode(self, ops: _Ops, raw: Any, spec: BlockSpec | None) -> Any:
        shape = self._check_spec(raw.shape[0], spec)
        assert spec is not None  # checked above
        sections = self._quantise(ops, ops.load(raw, spec.dtype, shape))
        preamble = Preamble(spec, raw.shape[0], self.param).pack()
        return ops.cat([ops.from_host(preamble, raw), *sections])

    def _decode(self, ops: _Ops, payload: Any, out: Any) -> None:
        head, body = self._head(ops, payload)
        check_out(out.shape[0], head.raw_length)
        assert head.spec.shape is not None  # checked by _head
        with np.errstate(over="ignore", invalid="ignore"):  # judged just below
            values = self._dequantise(ops, body, head.spec.shape)
        # A crafted payload (valid CRC, since its writer computed it) can decode to NaN codes,
        # or to scales that overflow the block's dtype: that is damage, not KV.
        if not ops.all_finite(values) or not ops.all_within(values, _DTYPE_MAX[head.spec.dtype]):
            raise CorruptEncodedError(
                f"payload decodes to values a {head.spec.dtype} block cannot hold"
            )
        ops.store(values, head.spec.dtype, out)

    # ------------------------------------------------------------------ host buffers (numpy)

    def encode(self, data: Bytes, spec: BlockSpec | None = None) -> Encoded:
        torch_ops = self._host_ops()
        if torch_ops is None:
            result: Bytes = self._encode(_NUMPY, data, spec)
            return result
        encoded = self._encode(torch_ops, torch_ops.host_tensor(data), spec)
        host: Bytes = encoded.numpy()
        return host

    def decode_into(self, payload: Bytes, out: Bytes) -> None:
        torch_ops = self._host_ops()
        if torch_ops is None:
            self._decode(_NUMPY, payload, out)
        else:
            self._decode(torch_ops, torch_ops.host_tensor(payload), torch_ops.host_tensor(out))

    def raw_length(self, payload: Bytes) -> int:
        return Preamble.unpack(payload).raw_length

    # ------------------------------------------------------------------ torch tensors

    def encode_tensor(self, kv: Any) -> Any:
        """The payload of one LKHTD block held in a torch tensor, on the tensor's device.

        Args:
            kv: ``[layers, 2, kv heads, tokens, head dim]``, bfloat16, float16 or float32, on
                any device.

        Returns:
            A flat uint8 tensor on the same device, byte for byte what `encode` produces.

        Raises:
            CodecMismatchError: `kv` does not have five dims with 2 in the second.
            UnsupportedCodecConfigError: an unsupported dtype or values out of range.
        """
        ops = _torch_ops()
        dtype = str(kv.dtype).removeprefix("torch.")
        if dtype not in _FLOATS or kv.dim() != 5:
            raise CodecMismatchError(
                f"expected a [layers, 2, heads, tokens, dim] tensor of {', '.join(_FLOATS)}, "
                f"got {tuple(kv.shape)} {dtype}"
            )
        spec = BlockSpec(dtype, tuple(kv.shape))
        raw = kv.contiguous().reshape(-1).view(ops.torch.uint8)
        return self._encode(ops, raw, spec)

    def decode_tensor(self, payload: Any, out: Any) -> Any:
        """Decode a uint8 payload tensor into `out` (a contiguous tensor of the block's dtype
        and shape, on the payload's device); returns `out`.

        Raises:
            CorruptEncodedError: the payload is malformed.
            CodecMismatchError: `out` does not hold exactly one block.
        """
        ops = _torch_ops()
        if not out.is_contiguous():
            raise CodecMismatchError("output tensor must be contiguous")
        self._decode(ops, payload.reshape(-1), out.reshape(-1).view(ops.torch.uint8))
        return out


class Fp8Codec(QuantCodec):
    """FP8 e4m3 with one float32 scale per layer, k/v and kv head: 2x on bf16, ~4x on fp32."""

    name = "fp8"
    codec_id = 16

    def _quantise(self, ops: _Ops, x: Any) -> list[Any]:
        amax = ops.amax(ops.abs(x), (3, 4))
        if not ops.all_finite(amax):
            raise UnsupportedCodecConfigError("fp8 cannot encode NaN or infinite values")
        scale = ops.where(amax > 0, amax / FP8_MAX, 1.0)
        y = x / scale[..., None, None]
        # x / (amax / 448) can land a rounding step above 448 at the maximum itself.
        return [ops.f32_bytes(scale), ops.to_fp8(y.clip(-FP8_MAX, FP8_MAX))]

    def _body_bytes(self, shape: tuple[int, int, int, int, int], param: int) -> int:
        layers, _, heads, tokens, dim = shape
        return 4 * layers * 2 * heads + math.prod(shape)

    def _dequantise(self, ops: _Ops, body: Any, shape: tuple[int, int, int, int, int]) -> Any:
        n_scales = shape[0] * 2 * shape[2]
        scale = ops.from_f32(body[: 4 * n_scales], (shape[0], 2, shape[2], 1, 1))
        _check_meta(ops, scale, scale=True)
        return ops.from_fp8(body[4 * n_scales :]).reshape(shape) * scale


def _check_meta(ops: _Ops, values: Any, *, scale: bool = False) -> None:
    """Scales and zero points as the encoder writes them: finite, scales not negative;
    anything else is a damaged payload."""
    if not ops.all_finite(values) or (scale and not ops.all_nonnegative(values)):
        raise CorruptEncodedError("payload holds scales no encoder writes")


def _group(length: int, limit: int) -> int:
    """The largest divisor of `length` not above `limit`."""
    return max(g for g in range(1, min(length, limit) + 1) if length % g == 0)


class Int4Codec(QuantCodec):
    """4-bit asymmetric groups, KIVI-style: keys per channel (groups of 32 tokens), values per
    token (groups of 32 channels), float16 scale and zero point per group."""

    name = "int4"
    codec_id = 17
    param = INT4_GROUP

    def _groups(self, shape: tuple[int, int, int, int, int]) -> tuple[int, int]:
        return _group(shape[3], self.param), _group(shape[4], self.param)

    def _meta_shapes(
        self, shape: tuple[int, int, int, int, int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        layers, _, heads, tokens, dim = shape
        gk, gv = self._groups(shape)
        return (layers, heads, tokens // gk, 1, dim), (layers, heads, tokens, dim // gv, 1)

    def _quantise(self, ops: _Ops, x: Any) -> list[Any]:
        layers, _, heads, tokens, dim = x.shape
        gk, gv = self._groups(x.shape)
        keys = x[:, 0].reshape(layers, heads, tokens // gk, gk, dim)
        values = x[:, 1].reshape(layers, heads, tokens, dim // gv, gv)
        meta, codes = [], []
        for group, axis in ((keys, 3), (values, 4)):
            low = ops.amin(group, (axis,), keepdims=True)
            high = ops.amax(group, (axis,), keepdims=True)
            zero = ops.via_half(low)
            scale = ops.via_half((high - low) / 15)
            if not (ops.all_finite(zero) and ops.all_finite(scale)):
                raise UnsupportedCodecConfigError(
                    "int4 keeps scales in float16: values must be finite and within ±65504"
                )
            codes.append(ops.codes((group - zero) / ops.where(scale > 0, scale, 1.0), 15))
            meta += [ops.half_bytes(zero), ops.half_bytes(scale)]
        # K and V each hold half of an LKHTD block, so the code count is always even.
        return [*meta, ops.pack4(ops.cat([c.reshape(-1) for c in codes]))]

    def _body_bytes(self, shape: tuple[int, int, int, int, int], param: int) -> int:
        k_meta, v_meta = self._meta_shapes(shape)
        return 4 * (math.prod(k_meta) + math.prod(v_meta)) + math.prod(shape) // 2

    def _dequantise(self, ops: _Ops, body: Any, shape: tuple[int, int, int, int, int]) -> Any:
        layers, _, heads, tokens, dim = shape
        gk, gv = self._groups(shape)
        count = math.prod(shape)
        pos = 0
        meta = []
        for meta_shape in self._meta_shapes(shape):
            size = 2 * math.prod(meta_shape)
            zero = ops.from_half(body[pos : pos + size], meta_shape)
            scale = ops.from_half(body[pos + size : pos + 2 * size], meta_shape)
            _check_meta(ops, zero)
            _check_meta(ops, scale, scale=True)
            meta.append((zero, scale))
            pos += 2 * size
        q = ops.unpack4(body[pos:])
        half = count // 2
        (k_zero, k_scale), (v_zero, v_scale) = meta
        k_codes = q[:half].reshape(layers, heads, tokens // gk, gk, dim)
        v_codes = q[half:].reshape(layers, heads, tokens, dim // gv, gv)
        keys = (k_codes * k_scale + k_zero).reshape(layers, 1, heads, tokens, dim)
        values = (v_codes * v_scale + v_zero).reshape(layers, 1, heads, tokens, dim)
        return ops.cat_kv(keys, values)
