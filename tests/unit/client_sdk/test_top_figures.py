"""The figures `kvoffload top` derives from two stats answers (tests/integration/test_top.py
drives the screen against real daemons)."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload.client_sdk.top import Figures, Top, figures, quantile, shown_url
from kvoffload.wire.shards import merge_stats

BOUNDS = [0.001, 0.01, 0.1]


def _stats(gets: int, hits: int, dram_hits: int, requests: int, counts: list[int]) -> Any:
    return {
        "gets": gets,
        "hits": hits,
        "evictions": gets // 2,
        "tiers": [
            {"name": "dram", "hits": dram_hits, "used_bytes": 50, "capacity_bytes": 200},
            {"name": "ssd", "hits": hits - dram_hits, "used_bytes": 0, "capacity_bytes": 800},
        ],
        "server": {
            "traffic": {
                "bytes_in": requests * 1000,
                "bytes_out": requests * 10,
                "requests": requests,
                "errors": 1,
                "latency_buckets": {f"{b:g}": c for b, c in zip(BOUNDS, counts, strict=True)},
            }
        },
    }


def test_quantile_interpolates_within_a_bucket_as_prometheus_does() -> None:
    assert quantile(0.5, BOUNDS, [0, 0, 0]) is None
    assert quantile(0.5, BOUNDS, [10, 10, 10]) == pytest.approx(0.0005)
    assert quantile(0.5, BOUNDS, [0, 10, 10]) == pytest.approx(0.0055)
    assert quantile(0.99, BOUNDS, [50, 90, 100]) == pytest.approx(0.01 + 0.09 * 0.9)
    assert quantile(0.5, BOUNDS, [0, 0, 4]) == pytest.approx(0.055)


def test_figures_are_the_interval_between_two_answers() -> None:
    before = _stats(10, 5, 5, 20, [10, 20, 20])
    now = _stats(30, 20, 10, 60, [10, 50, 60])
    f = figures(before, now, 2.0)
    assert f.rate(f.requests) == 20.0
    assert f.rate(f.bytes_in) == 20_000.0
    assert f.ratio(f.hits) == 0.75
    assert f.ratio(f.tier_hits["dram"]) == 0.25 and f.ratio(f.tier_hits["ssd"]) == 0.5
    assert f.rate(f.evictions) == 5.0
    assert f.errors == 0
    # 40 in the interval, 30 of them in (1 ms, 10 ms]: the 20th lies 2/3 of the way in.
    assert f.percentile(0.5) == pytest.approx(0.001 + 0.009 * 20 / 30)
    assert f.used["dram"] / f.capacity["dram"] == 0.25


def test_a_restarted_node_counts_from_zero_and_a_first_answer_has_no_rates() -> None:
    first = figures(None, _stats(30, 20, 10, 60, [1, 2, 3]), 0.0)
    assert first.rate(first.requests) is None and first.percentile(0.5) is None
    assert first.capacity == {"dram": 200, "ssd": 800}
    after = figures(_stats(30, 20, 10, 60, [1, 2, 3]), _stats(4, 2, 1, 6, [6, 6, 6]), 1.0)
    assert after.requests == 6 and after.gets == 4 and after.tier_hits["dram"] == 1


def test_cluster_totals_add_rates_and_rederive_ratios() -> None:
    a = figures(_stats(0, 0, 0, 0, [0, 0, 0]), _stats(10, 10, 10, 10, [10, 10, 10]), 1.0)
    b = figures(_stats(0, 0, 0, 0, [0, 0, 0]), _stats(30, 0, 0, 30, [0, 0, 30]), 1.0)
    total = Figures()
    total.add(a)
    total.add(b)
    assert total.rate(total.requests) == 40.0
    assert total.ratio(total.hits) == 0.25
    assert total.latency == [10, 10, 40]
    assert total.capacity["ssd"] == 1600


def test_the_shown_url_keeps_secrets_off_the_screen() -> None:
    assert shown_url("kv://127.0.0.1:7480?token=s3cret") == "kv://127.0.0.1:7480"
    shown = shown_url("cluster+etcd://user:pw@etcd:2379/prod?token=s3cret&members_key=/k")
    assert shown == "cluster+etcd://etcd:2379/prod"


def test_a_multi_worker_nodes_shards_add_up() -> None:
    # The SDK merges the shards' stats answers (wire.shards.merge_stats): the latency
    # histogram is a map, so its counts add per bound as the other traffic figures do.
    one = _stats(10, 5, 5, 20, [10, 20, 20])
    two = _stats(30, 15, 5, 40, [0, 30, 40])
    node = merge_stats([one, two])
    f = figures(_stats(0, 0, 0, 0, [0, 0, 0]), node, 1.0)
    assert f.requests == 60 and f.bytes_in == 60_000
    assert f.latency == [10, 50, 60]


def test_a_nodes_url_keeps_its_own_parameters_and_gets_short_deadlines_otherwise() -> None:
    top = Top("kv://10.0.0.5:7480?timeout=5&token=mine", timeout_s=1.0, token="flag")
    try:
        top._refresh_members()
        (node,) = top.nodes.values()
        # A repeated parameter would be refused by the URL parser: the URL's own win.
        assert node.url == "kv://10.0.0.5:7480?timeout=5&token=mine&connect_timeout=1.0&retries=0"
        assert node.name == "10.0.0.5:7480"
    finally:
        top.close()
    top = Top("kv://10.0.0.5:7480", timeout_s=2.0, token="flag")
    try:
        top._refresh_members()
        (node,) = top.nodes.values()
        assert node.url == "kv://10.0.0.5:7480?timeout=2.0&connect_timeout=2.0&retries=0&token=flag"
    finally:
        top.close()


def test_errors_shown_for_a_down_node_keep_its_secrets_off_the_screen() -> None:
    top = Top("cluster+etcd://ops:pw@etcd:2379/prod?token=urlsecret", token="flagsecret")
    try:
        url = "kv://10.0.0.5:7480?timeout=1.0&token=flagsecret"
        shown = top._scrubbed(f"refused {url}: flagsecret, urlsecret, pw", url)
        assert shown == "refused kv://10.0.0.5:7480: ***, ***, ***"
    finally:
        top.close()
