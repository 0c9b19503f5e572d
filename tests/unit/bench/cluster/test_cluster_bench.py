"""`kvoffload bench cluster`: the rows exist, meet issue 12's goals and write DESIGN §9 JSON."""

from __future__ import annotations

import json
from pathlib import Path

from kvoffload.bench.cluster import cluster_bench
from kvoffload.cli import main


def test_rows_meet_the_goals(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    argv = ["bench", "cluster", "--keys", "40000", "--lookups", "10", "--failover-window", "0"]
    argv += ["--throughput-rounds", "0", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    rows = {r["case"]: r for r in doc["rows"]}
    assert doc["bench"] == "cluster" and doc["machine"]["cpus"]
    assert 1.0 <= rows["balance/4targets"]["value"] <= cluster_bench.GOAL_BALANCE
    assert 0.18 <= rows["moved_on_add/4to5"]["value"] <= cluster_bench.GOAL_MOVED
    assert rows["place/1000keys/4targets"]["unit"] == "ms"
    # A real lookup through cluster:// to 4 daemons: measured, against the goal, not asserted
    # to meet it (timings do not belong in tests on a shared machine).
    lookup = rows["lookup/1000keys/4targets"]
    assert lookup["unit"] == "ms" and lookup["value"] > 0
    assert lookup["ref"] == "goal_p50" and lookup["ref_value"] == cluster_bench.GOAL_LOOKUP_MS
    assert rows["lookup_p99/1000keys/4targets"]["value"] >= lookup["value"]


def test_the_measures_see_imbalance_and_movement() -> None:
    keys = cluster_bench.block_keys(4000, seed=3)
    four = cluster_bench.targets(4)
    # A target with twice the weight of the others takes twice their share: the measure
    # reports it (max/mean = 2/1.25 = 1.6), so a balanced result is not a constant.
    heavy = [*four[:3], cluster_bench.Member(four[3].node_id, four[3].fronts, 2.0)]
    assert cluster_bench.balance(heavy, keys) > 1.4
    assert cluster_bench.moved_fraction(four, four, keys) == 0.0
    assert cluster_bench.moved_fraction(four, four[:2], keys) > 0.45
