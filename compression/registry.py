"""Codec registry: names and ids -> lazily imported codec classes.

Codec ids are stored in every block header and are never reused: a reader maps the id back to
its codec, so an id means the same payload format forever. Entries name their class as
``"module:Class"`` and are imported on first use, so naming a codec (in a `Namespace`, say)
costs no import of zstandard, lz4 or torch.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any

from kvoffload.compression.base import Codec
from kvoffload.errors import UnsupportedCodecConfigError

__all__ = [
    "CODEC_NONE",
    "CodecInfo",
    "codec_for_id",
    "codec_info",
    "codec_infos",
    "get_codec",
    "register_codec",
]

CODEC_NONE = 0


@dataclass(frozen=True, slots=True)
class CodecInfo:
    """One registry entry."""

    name: str
    codec_id: int
    lossless: bool
    target: str  # "module:Class"
    summary: str

    def load(self) -> type[Codec]:
        module_name, _, class_name = self.target.partition(":")
        cls: type[Codec] = getattr(importlib.import_module(module_name), class_name)
        if (cls.name, cls.codec_id, cls.lossless) != (self.name, self.codec_id, self.lossless):
            raise UnsupportedCodecConfigError(
                f"{self.target} declares {cls.name!r}/{cls.codec_id}, registered as "
                f"{self.name!r}/{self.codec_id}"
            )
        return cls


_BY_NAME: dict[str, CodecInfo] = {}
_BY_ID: dict[int, CodecInfo] = {}
# Decoders are stateless; one default instance per id serves every read.
_DEFAULTS: dict[int, Codec] = {}
_LOCK = threading.Lock()


def register_codec(info: CodecInfo) -> None:
    """Add a codec to the registry.

    Raises:
        UnsupportedCodecConfigError: the name or id is already taken, or the id is out of the
            header's u16 range.
    """
    if not 0 <= info.codec_id < 2**16:
        raise UnsupportedCodecConfigError(f"codec id {info.codec_id} does not fit a u16")
    with _LOCK:
        if info.name in _BY_NAME:
            raise UnsupportedCodecConfigError(f"codec name {info.name!r} is already registered")
        if info.codec_id in _BY_ID:
            taken = _BY_ID[info.codec_id].name
            raise UnsupportedCodecConfigError(f"codec id {info.codec_id} is taken by {taken!r}")
        _BY_NAME[info.name] = info
        _BY_ID[info.codec_id] = info


def codec_infos() -> list[CodecInfo]:
    """Every registered codec, by id."""
    return sorted(_BY_NAME.values(), key=lambda i: i.codec_id)


def codec_info(name: str) -> CodecInfo:
    """The registry entry of `name`.

    Raises:
        UnsupportedCodecConfigError: unknown name; the message lists the valid ones.
    """
    info = _BY_NAME.get(name)
    if info is None:
        valid = ", ".join(f"{i.name} ({i.summary})" for i in codec_infos())
        raise UnsupportedCodecConfigError(f"unknown codec {name!r}; valid: {valid}")
    return info


def get_codec(name: str, **options: Any) -> Codec:
    """A codec instance by registry name; `options` go to its constructor (level, threads).

    Raises:
        UnsupportedCodecConfigError: unknown name or option.
    """
    info = codec_info(name)
    if not options:
        return codec_for_id(info.codec_id)
    try:
        return info.load()(**options)
    except TypeError as exc:
        raise UnsupportedCodecConfigError(f"bad options for codec {name!r}: {exc}") from None


def codec_for_id(codec_id: int) -> Codec:
    """The default instance of the codec with header id `codec_id` (what readers use).

    Raises:
        UnsupportedCodecConfigError: no codec has this id (a block written by a newer version,
            or damage that kept the header checksum valid).
    """
    codec = _DEFAULTS.get(codec_id)
    if codec is not None:
        return codec
    info = _BY_ID.get(codec_id)
    if info is None:
        valid = ", ".join(f"{i.codec_id} ({i.name})" for i in codec_infos())
        raise UnsupportedCodecConfigError(f"unknown codec id {codec_id}; this build knows {valid}")
    codec = info.load()()
    with _LOCK:
        return _DEFAULTS.setdefault(codec_id, codec)


for _info in (
    CodecInfo("none", CODEC_NONE, True, "kvoffload.compression.lossless:NoneCodec", "raw"),
    CodecInfo("lz4", 1, True, "kvoffload.compression.lossless:Lz4Codec", "LZ4 on the bytes"),
    CodecInfo("zstd", 2, True, "kvoffload.compression.lossless:ZstdCodec", "zstd-1 on the bytes"),
    CodecInfo(
        "split-lz4",
        3,
        True,
        "kvoffload.compression.lossless:SplitLz4Codec",
        "byte planes of bf16/fp16/fp32, then LZ4",
    ),
    CodecInfo(
        "split-zstd",
        4,
        True,
        "kvoffload.compression.lossless:SplitZstdCodec",
        "byte planes of bf16/fp16/fp32, then zstd",
    ),
    CodecInfo(
        "fp8",
        16,
        False,
        "kvoffload.compression.lossy:Fp8Codec",
        "lossy: FP8 e4m3, one scale per layer, k/v and head",
    ),
    CodecInfo(
        "int4",
        17,
        False,
        "kvoffload.compression.lossy:Int4Codec",
        "lossy: 4-bit groups, keys per channel, values per token (KIVI)",
    ),
):
    register_codec(_info)
