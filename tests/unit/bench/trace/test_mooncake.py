"""The Mooncake FAST'25 trace: reading it, the offline optimum and the fast policy replay, and
the issue 32 sanity figures on the real trace (the committed xz copy, so a clean clone has it)."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import numpy as np
import pytest

from kvoffload.bench.trace import ttft
from kvoffload.bench.trace.model import Workload, block_slot
from kvoffload.bench.trace.mooncake import read_trace, window
from kvoffload.bench.trace.offline import optimum_hits, simulate
from kvoffload.bench.trace.replay import Payloads, replay
from kvoffload.bench.trace.workload import PROFILES, write_jsonl
from kvoffload.cli import main
from kvoffload.client_sdk import Client
from kvoffload.errors import ConfigError
from kvoffload.kvstore import make_policy

ROOT = Path(__file__).resolve().parents[4]
TRACE = ROOT / "bench" / "data" / "mooncake-fast25" / "conversation_trace.jsonl.xz"
MODEL = PROFILES["llama-3.1-8b"]


def _record(t: int, n: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": t, "input_length": n, "output_length": 7, "hash_ids": ids})


@pytest.fixture(scope="module")
def full() -> Workload:
    return Workload.build(read_trace(TRACE), MODEL, 512)


def test_reads_the_format_detected_from_its_fields(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(
            [
                _record(0, 1100, [0, 1, 2]),
                "",
                _record(1500, 1024, [0, 1]),
                _record(2500, 600, [0, 3]),
            ]
        )
        + "\n"  # fmt: skip
    )
    trace = read_trace(path)
    assert trace.block_tokens == 512 and len(trace.requests) == 3
    assert [r.prompt_tokens for r in trace.requests] == [1100, 1024, 600]
    assert [r.arrival for r in trace.requests] == [0.0, 1.5, 2.5]
    work = Workload.build(trace, MODEL, 512)
    a, b, c = work.chains
    assert b == a[:2] and c[0] == a[0] and c[1] not in a  # equal ids, equal keys
    assert len({k for chain in work.chains for k in chain}) == work.working_set == 4
    other = Workload.build(trace, PROFILES["smollm2-135m"], 512)
    assert not set(other.chains[0]) & set(a)  # another model's namespace: other keys
    with pytest.raises(ConfigError, match="512-token blocks"):
        Workload.build(trace, MODEL, 16)
    again = tmp_path / "again.jsonl"
    write_jsonl(trace, again)
    assert again.read_text().splitlines() == [
        line for line in path.read_text().splitlines() if line
    ]
    late = window(trace, 1.0, 3.0)
    assert [r.arrival for r in late.requests] == [1.5, 2.5] and late.block_tokens == 512
    with pytest.raises(ConfigError, match="no request"):
        window(trace, 10.0, 20.0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0], "x": 1}',
         "exactly"),
        (_record(0, 1100, [0, 1]), "2 hash_ids for 1100"),
        (_record(-1, 10, [0]), "timestamp must be"),
        (_record(0, 10, [-3]), "hash_ids must be"),
        (_record(0, 10, [0])[:-2], "not JSON"),
    ],
)  # fmt: skip
def test_a_bad_line_is_a_config_error_naming_it(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_record(0, 10, [0]) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=f"line 2: .*{message}"):
        read_trace(path)


def test_the_optimum_bypasses_blocks_not_worth_their_slot() -> None:
    # One slot. [1] is used again at request 2, [2] at 3 (later): storing [2] after request 1
    # would evict [1] and lose its hit, so the optimum bypasses [2] and hits [1] only; without
    # bypass (every computed block stored) nothing would hit.
    chains = [[1], [2], [1], [2]]
    assert optimum_hits(chains, 1).tolist() == [0, 0, 1, 0]
    # leading hits: [5, 6] hits nothing at request 2 when 5 is gone, even with 6 resident
    assert optimum_hits([[5, 6], [5, 6]], 2).tolist() == [0, 2]
    assert optimum_hits([[5, 6], [5, 6]], 1).tolist() == [0, 1]


def test_issue_sanity_figures_on_the_real_trace(full: Workload) -> None:
    """Issue 32: 63% first touches; the optimum reaches 0.366 of all block accesses from 5% of
    the distinct blocks on; LRU reaches 0.53x of it at 5%, 0.76x at 10%, 0.98x at 30%."""
    assert len(full.chains) == 12_031
    assert full.working_set / full.block_accesses == pytest.approx(0.634, abs=5e-4)
    lru_share = {5: 0.53, 10: 0.76, 30: 0.98}
    for percent, share in lru_share.items():
        capacity = round(full.working_set * percent / 100)
        best = int(optimum_hits(full.chains, capacity).sum())
        assert best / full.block_accesses == pytest.approx(0.366, abs=5e-4)
        lru = int(simulate(full.chains, lambda: make_policy("lru"), capacity).sum())
        assert lru / best == pytest.approx(share, abs=5e-3)


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "prefix", "reuse"])
def test_the_fast_replay_gives_the_engines_hits(full: Workload, policy: str) -> None:
    """`simulate` stands in for the engine in the policy grid: on the trace's first two
    minutes it must give every request the hits a real store gives it."""
    trace = window(full.trace, 0, 120)
    work = Workload.build(trace, MODEL, 512)
    slot = block_slot(64)
    capacity = round(work.working_set * 0.05)
    url = f"local://?dram={capacity * slot}&max_value={slot}&prefault=0&policy={policy}"
    with Client.connect(url, namespace=work.namespace) as client:
        got = replay(client, work.chains, work.prompt_tokens, Payloads(64), block_tokens=512)
        assert client.stats().store["evictions"] > 0
    expected = simulate(work.chains, lambda: make_policy(policy), capacity)
    assert got.hit_blocks.tolist() == expected.tolist()


def test_a_hit_on_a_partial_last_block_never_makes_prefill_negative() -> None:
    prompt = np.array([600], dtype=np.int64)
    cached = np.array([1024], dtype=np.int64)  # two 512-token blocks, the second partial
    got = ttft.prefill_seconds(MODEL, ttft.GPUS["h100"], prompt, cached)
    assert got.tolist() == [0.0]


def test_bench_trace_runs_a_mooncake_slice(tmp_path: Path) -> None:
    head = lzma.decompress(TRACE.read_bytes()).decode().splitlines()[:300]  # a plain file
    path = tmp_path / "head.jsonl"
    path.write_text("\n".join(head) + "\n")
    out = tmp_path / "out.json"
    args = ["bench", "trace", "--trace", str(path), "--capacities", "5,30", "--tiers", "dram",
            "--policies", "lru,s3fifo", "--no-realistic", "--layer-parts", "1",
            "--model", "smollm2-135m", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    details = json.loads(out.read_text())["details"]
    assert details["block_tokens"] == 512 and details["peers"] == {}
    optimum = details["optimum"]["capacities"]
    for percent in ("5", "30"):
        entry = optimum[percent]
        assert entry["lru"]["of_lru"] == 1.0
        assert 0 < entry["lru"]["of_optimum"] <= 1.0
        assert 0 < entry["s3fifo"]["of_optimum"] <= 1.0
    notes = json.loads(out.read_text())["notes"]
    assert any("scale 1:" in n for n in notes) and any("not run" in n for n in notes)
