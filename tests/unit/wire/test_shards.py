"""Shard placement, how a chain's leading run is rebuilt from per-shard lookups, and how
shards' stats add up (kvoffload/wire/shards.py, transports/native/shards.py)."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from kvoffload.client_sdk.keys import to_key
from kvoffload.client_sdk.request_layer import to_keys
from kvoffload.client_sdk.transports.sharding import gather, groups_of, leading_run, pick
from kvoffload.errors import KVOffloadError
from kvoffload.wire.native import fields
from kvoffload.wire.shards import merge_stats, shard_of


def test_placement_is_stable_and_spreads_keys() -> None:
    keys = [i.to_bytes(16, "big") for i in range(4000)]
    counts = [0] * 4
    for key in keys:
        counts[shard_of(key, 4)] += 1
        assert shard_of(key, 4) == shard_of(bytes(key), 4)  # a function of the bytes alone
        assert shard_of(key, 1) == 0
    assert min(counts) > 900  # about 1,000 each


@given(
    present=st.lists(st.booleans(), max_size=60),
    count=st.integers(min_value=1, max_value=7),
)
def test_the_leading_run_from_shards_is_the_chains(present: list[bool], count: int) -> None:
    keys = [i.to_bytes(16, "big") for i in range(len(present))]
    stored = {k for k, p in zip(keys, present, strict=True) if p}
    groups = groups_of(keys, count)
    # Each shard answers lookup over its own keys, in order: its leading run.
    runs = []
    for positions in groups.values():
        run = 0
        while run < len(positions) and keys[positions[run]] in stored:
            run += 1
        runs.append(run)
    expected = next((i for i, p in enumerate(present) if not p), len(present))
    assert leading_run(len(keys), groups, runs) == expected


def test_answers_go_back_in_the_order_asked() -> None:
    keys = [i.to_bytes(16, "big") for i in range(50)]
    groups = groups_of(keys, 3)
    parts = [[keys[i] for i in at] for at in groups.values()]
    assert gather(len(keys), groups, parts) == keys


def test_stats_add_up_per_tier_and_tenant() -> None:
    a = {
        "puts": 3,
        "policy": "lru",
        "tiers": [{"name": "dram", "entries": 2, "hits": 1}],
        "tenant_bytes": {"alice": 10},
        "server": {"uptime_s": 5.0, "connections": 1, "version": "x"},
    }
    b = {
        "puts": 4,
        "policy": "lru",
        "tiers": [{"name": "dram", "entries": 5, "hits": 0}, {"name": "ssd", "entries": 7}],
        "tenant_bytes": {"alice": 1, "bob": 2},
        "server": {"uptime_s": 6.5, "connections": 2, "version": "x"},
    }
    merged = merge_stats([a, b])
    assert merged["puts"] == 7 and merged["policy"] == "lru"
    assert merged["tiers"] == [
        {"name": "dram", "entries": 7, "hits": 1},
        {"name": "ssd", "entries": 7},
    ]
    assert merged["tenant_bytes"] == {"alice": 11, "bob": 2}
    assert merged["server"] == {"uptime_s": 6.5, "connections": 3, "version": "x"}
    assert a["tiers"] == [{"name": "dram", "entries": 2, "hits": 1}]  # inputs untouched


def test_merge_stats_takes_a_flag_from_any_shard_not_the_count_of_shards() -> None:
    # Three workers on one kernel that cannot share the arena's table: the node's flag is 1,
    # the rings and their counters add up.
    def worker(flag: int) -> dict[str, object]:
        ssd = {"name": "ssd", "io_rings": 2, "io_submissions": 5, "io_clone_unsupported": flag}
        return {"tiers": [ssd]}

    merged = merge_stats([worker(1), worker(1), worker(1)])
    assert merged["tiers"] == [
        {"name": "ssd", "io_rings": 6, "io_submissions": 15, "io_clone_unsupported": 1}
    ]
    (ssd,) = merge_stats([worker(0), worker(1)])["tiers"]  # type: ignore[misc]
    assert ssd["io_clone_unsupported"] == 1


def test_nvme_urls_name_a_multi_worker_daemons_subsystems() -> None:
    import pytest

    from kvoffload.client_sdk.transports.nvme.options import NvmeOptions
    from kvoffload.client_sdk.url import parse_url
    from kvoffload.errors import ConfigError

    base = "nvme+tcp://10.0.0.5:4420/nqn.2026-11.io.kvoffload:store"
    options = NvmeOptions.from_url(parse_url(base + "?shards=3"))
    assert options.shard_ports == (4420, 4421, 4422)
    second = options.shard(1)
    assert (second.port, second.subnqn, second.shard_ports) == (
        4421,
        "nqn.2026-11.io.kvoffload:store.shard1",
        (),
    )
    assert NvmeOptions.from_url(parse_url(base + "?ports=5000,6000")).shard_ports == (5000, 6000)
    assert NvmeOptions.from_url(parse_url(base)).shard_ports == ()
    for bad in ("?shards=x", "?ports=1,70000", "?shards=0"):
        with pytest.raises(ConfigError, match="shard"):
            NvmeOptions.from_url(parse_url(base + bad))


_KEYISH = st.one_of(
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=0, max_size=40),
    st.binary(min_size=16, max_size=16).map(bytearray),
    st.integers(0, 3),
    st.text(max_size=3),
)


def _outcome(f: Callable[[], object]) -> object:
    try:
        return ("ok", f())
    except KVOffloadError as exc:
        return ("error", type(exc), str(exc))


@given(st.lists(_KEYISH, max_size=12), st.booleans())
def test_the_fast_key_checks_answer_as_the_per_key_ones(keys: list[object], as_tuple: bool) -> None:
    """The client's and the codec's checks of a key list take a shortcut when every key is a
    16-byte `bytes`: same result (or the same error) as checking key by key."""
    seq = tuple(keys) if as_tuple else keys
    assert _outcome(lambda: fields._keys(seq)) == _outcome(lambda: fields._seq(fields._key)(seq))
    assert _outcome(lambda: to_keys(seq)) == _outcome(lambda: [to_key(k) for k in seq])  # type: ignore[arg-type]


@given(st.lists(st.binary(min_size=16, max_size=16), max_size=40), st.integers(1, 5))
def test_one_shard_groups_every_key_and_passes_the_keys_through(keys: list[bytes], n: int) -> None:
    groups = groups_of(keys, n)
    assert sorted(i for at in groups.values() for i in at) == list(range(len(keys)))
    for at in groups.values():
        assert list(pick(keys, at)) == [keys[i] for i in at]
    if n == 1 and keys:
        assert groups == {0: list(range(len(keys)))} and pick(keys, groups[0]) is keys
