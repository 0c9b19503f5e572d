"""`TierRun` (wire/tiers.py): segments built, sliced, joined and carried on the wire; the
engine's tiered lookup that feeds it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.client_sdk import Client, Tier, TierRun
from kvoffload.client_sdk.transports.sharding import merge_tier_runs
from kvoffload.errors import InvalidArgumentError
from kvoffload.kvstore import Engine, EngineConfig
from kvoffload.wire.tiers import wire_pairs

D, S, R, U = Tier.DRAM, Tier.SSD, Tier.REMOTE, Tier.UNKNOWN
tiers_lists = st.lists(st.sampled_from([D, S, R, U]), max_size=40)


@given(tiers_lists)
def test_segments_hold_the_tiers_in_order(tiers: list[Tier]) -> None:
    run = TierRun.from_tiers(tiers)
    assert run.tiers() == tiers and run.total == len(tiers)
    assert all(n > 0 for _, n in run.segments)
    assert all(a[0] != b[0] for a, b in zip(run.segments, run.segments[1:], strict=False))
    assert (run.dram, run.ssd, run.remote, run.unknown) == tuple(
        tiers.count(t) for t in (D, S, R, U)
    )


@given(tiers_lists, st.integers(0, 45), st.integers(0, 45))
def test_slice_and_then_agree_with_lists(tiers: list[Tier], a: int, b: int) -> None:
    run = TierRun.from_tiers(tiers)
    assert run.slice(a, b).tiers() == tiers[a:b]
    assert run.slice(0, a).then(run.slice(a)) == run


def test_wire_form() -> None:
    run = TierRun.from_tiers([D, D, S, D])
    assert run.to_wire() == (1, 2, 2, 1, 1, 1)
    assert TierRun.from_wire(run.to_wire()) == run
    assert wire_pairs(["dram", "ssd", "ssd"]) == (1, 1, 2, 2)
    assert TierRun.of(S, 0) == TierRun() and TierRun().to_wire() == ()


def test_shard_answers_merge_in_key_order() -> None:
    # Keys 0..5; shard 0 holds positions 0, 2, 4 and shard 1 positions 1, 3, 5.
    groups = {0: [0, 2, 4], 1: [1, 3, 5]}
    # Shard 0 has all three (D, S, D); shard 1 has the first (S) and misses position 3.
    runs = [TierRun.from_tiers([D, S, D]), TierRun.from_tiers([S])]
    assert merge_tier_runs(6, groups, runs).tiers() == [D, S, S]
    full = [TierRun.from_tiers([D, S, D]), TierRun.from_tiers([S, S, D])]
    assert merge_tier_runs(6, groups, full).tiers() == [D, S, S, S, D, D]


def test_the_engine_answers_from_its_indexes(tmp_path: Path) -> None:
    keys = [bytes([i]) * 16 for i in range(6)]
    with Client.connect(f"local://{tmp_path}?dram=4MiB&ssd=8MiB&max_value=64KiB") as client:
        for key in keys[:5]:
            client.put(key, b"x" * 100, durable=True)
    with Client.connect(f"local://{tmp_path}?dram=4MiB&max_value=64KiB") as client:
        eng = client.transport.engine  # type: ignore[attr-defined]
        assert isinstance(eng, Engine)
        where: list[str] = []
        before = eng.stats().as_dict()
        assert eng.lookup(keys, where) == 5 and where == ["ssd"] * 5
        assert client.get(keys[1]) is not None  # promoted into DRAM
        where.clear()
        assert eng.lookup(keys, where) == 5 and where == ["ssd", "dram", "ssd", "ssd", "ssd"]
        after = eng.stats().as_dict()
        # The lookups read nothing: the one get is the only read.
        assert after["gets"] == before["gets"] + 1


def test_a_bad_key_is_refused_with_or_without_tiers() -> None:
    engine = Engine(EngineConfig())
    try:
        assert engine.lookup([bytes(16)], []) == 0
        with pytest.raises(InvalidArgumentError):
            engine.lookup([b"short"], [])
    finally:
        engine.close()
