from __future__ import annotations

import pytest

from kvoffload.errors import ConfigError
from kvoffload.kvstore import DramConfig, SsdConfig, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("1KiB", 1024),
        ("1 GiB", 1 << 30),
        ("1.5MiB", 3 << 19),
        ("2GB", 2 * 10**9),
        ("8mib", 8 << 20),
        (12, 12),
        ("0", 0),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "1 parsec", "GiB", "1e9", "1..5MiB", True])
def test_parse_size_rejects_garbage(text: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)  # type: ignore[arg-type]


def test_negative_int_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="negative"):
        parse_size(-5)


def test_format_size_round_trips_roughly() -> None:
    assert format_size(1 << 30) == "1.0 GiB"
    assert format_size(512) == "512 B"
    assert parse_size(format_size(3 << 20).replace(" ", "")) == 3 << 20


def test_defaults_derive_max_value() -> None:
    cfg = DramConfig(capacity_bytes=64 << 20)
    assert cfg.effective_max_value_bytes == 4 << 20
    big = DramConfig(capacity_bytes=16 << 30, prefault=False)
    assert big.effective_max_value_bytes == 64 << 20


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_bytes": 0},
        {"capacity_bytes": -1},
        {"capacity_bytes": 1 << 20, "max_value_bytes": 2 << 20},
        {"max_value_bytes": -1},
        {"policy": "mru"},
    ],
)
def test_bad_dram_config_is_a_clear_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        DramConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_policy_lists_valid_ones() -> None:
    with pytest.raises(ConfigError, match="lru.*prefix.*s3fifo|prefix"):
        DramConfig(policy="clock")


@pytest.mark.parametrize("depth", [0, 257])
def test_read_depth_out_of_range_is_a_clear_error(depth: int) -> None:
    with pytest.raises(ConfigError, match="read_depth"):
        SsdConfig(read_depth=depth)


def test_every_evicted_block_is_admitted_to_the_ssd_by_default() -> None:
    assert SsdConfig().admission_min_uses == 1
