"""Codecs for KV blocks: lossless (`none`, `lz4`, `zstd`, `split-lz4`, `split-zstd`) and lossy
(`fp8`, `int4`), found by name or by the codec id stored in every block header (DESIGN §3).

A codec encodes a block's raw bytes (plus, where it helps, a `BlockSpec`: dtype and KV shape)
into a self-describing payload and decodes a payload into a caller's buffer::

    codec = get_codec("split-zstd")
    payload = codec.encode(raw, BlockSpec.kv("bfloat16", 30, 3, 16, 64))
    codec_for_id(codec.codec_id).decode_into(as_payload(payload), out)

Importing this package is cheap: codec modules (zstandard, lz4) load on first use.
"""

from kvoffload.compression.base import (
    DTYPE_BYTES,
    PREAMBLE_BYTES,
    BlockSpec,
    Bytes,
    Codec,
    Encoded,
    as_payload,
)
from kvoffload.compression.registry import (
    CODEC_NONE,
    CodecInfo,
    codec_for_id,
    codec_info,
    codec_infos,
    get_codec,
    register_codec,
)
from kvoffload.errors import (
    CodecError,
    CodecMismatchError,
    CorruptEncodedError,
    UnsupportedCodecConfigError,
)

__all__ = [
    "CODEC_NONE",
    "DTYPE_BYTES",
    "PREAMBLE_BYTES",
    "BlockSpec",
    "Bytes",
    "Codec",
    "CodecError",
    "CodecInfo",
    "CodecMismatchError",
    "CorruptEncodedError",
    "Encoded",
    "UnsupportedCodecConfigError",
    "as_payload",
    "codec_for_id",
    "codec_info",
    "codec_infos",
    "get_codec",
    "register_codec",
]
