"""The codec registry: names, ids, options, duplicates, unknown names and ids."""

from __future__ import annotations

import pytest

from kvoffload.compression import (
    CODEC_NONE,
    CodecInfo,
    UnsupportedCodecConfigError,
    codec_for_id,
    codec_info,
    codec_infos,
    get_codec,
    register_codec,
)


def test_every_entry_loads_a_class_that_matches_it() -> None:
    infos = codec_infos()
    assert [i.name for i in infos] == [
        "none",
        "lz4",
        "zstd",
        "split-lz4",
        "split-zstd",
        "fp8",
        "int4",
    ]
    for info in infos:
        codec = codec_for_id(info.codec_id)
        assert (codec.name, codec.codec_id, codec.lossless) == (
            info.name,
            info.codec_id,
            info.lossless,
        )
        assert get_codec(info.name) is codec  # readers share one default instance
    assert codec_for_id(CODEC_NONE).name == "none"
    assert [i.name for i in infos if not i.lossless] == ["fp8", "int4"]


def test_unknown_names_and_ids_list_the_valid_ones() -> None:
    with pytest.raises(UnsupportedCodecConfigError, match="unknown codec 'gzip'.*split-zstd"):
        get_codec("gzip")
    with pytest.raises(UnsupportedCodecConfigError, match="unknown codec id 999.*4 \\(split-zstd"):
        codec_for_id(999)


def test_duplicates_are_refused() -> None:
    target = "kvoffload.compression.lossless:ZstdCodec"
    with pytest.raises(UnsupportedCodecConfigError, match="already registered"):
        register_codec(CodecInfo("zstd", 900, True, target, "again"))
    with pytest.raises(UnsupportedCodecConfigError, match="taken by 'zstd'"):
        register_codec(CodecInfo("zstd-again", 2, True, target, "same id"))
    with pytest.raises(UnsupportedCodecConfigError, match="u16"):
        register_codec(CodecInfo("huge", 70_000, True, target, "id too large"))
    assert codec_info("zstd").codec_id == 2


def test_options_make_new_instances_and_bad_options_are_errors() -> None:
    fast = get_codec("split-zstd", level=3, threads=2)
    assert fast is not get_codec("split-zstd")
    assert "threads=2" in repr(fast)
    with pytest.raises(UnsupportedCodecConfigError, match="bad options"):
        get_codec("zstd", colour="blue")
    with pytest.raises(UnsupportedCodecConfigError, match="positive"):
        get_codec("zstd", threads=0)
    with pytest.raises(UnsupportedCodecConfigError, match="backend"):
        get_codec("fp8", backend="cupy")
