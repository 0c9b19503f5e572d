"""The trace replay: correctness only (bit-exact hits, totals that add up), never timings."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload.bench.peers import peer_driver
from kvoffload.bench.trace import ttft
from kvoffload.bench.trace.replay import Payloads, replay
from kvoffload.bench.trace.trace_bench import Workload, _peer_runs, _peer_work, block_slot, plan
from kvoffload.bench.trace.workload import PROFILES, TraceShape, generate, write_jsonl
from kvoffload.cli import main
from kvoffload.client_sdk import Client, Tier, TierRun
from kvoffload.errors import ConfigError, CorruptBlockError

PAYLOAD = 3968  # + 96-byte header = one 4 KiB slot


@pytest.fixture(scope="module")
def work() -> Workload:
    trace = generate(TraceShape(sessions=8), seed=11)
    return Workload.build(trace, PROFILES["llama-3.1-8b"], 16)


def _url(blocks: int, policy: str) -> str:
    slot = block_slot(PAYLOAD)
    return f"local://?dram={blocks * slot}&max_value={slot}&slab={slot}&prefault=0&policy={policy}"


def _check_totals(result: object, work: Workload, client_stats: dict[str, object]) -> None:
    from kvoffload.bench.trace.replay import ReplayResult

    assert isinstance(result, ReplayResult)
    # every request: hit + computed = prompt tokens, hits never beyond the chain
    assert np.array_equal(result.hit_tokens + result.computed_tokens, work.prompt_tokens)
    chain_lengths = np.array([len(c) for c in work.chains])
    assert np.all(result.hit_blocks <= chain_lengths)
    assert np.array_equal(result.hit_blocks + result.stored_blocks, chain_lengths)
    # bytes read = hit blocks x block bytes; bytes written = stored blocks x block bytes
    assert client_stats["bytes_got"] == result.bytes_read == int(result.hit_blocks.sum()) * PAYLOAD
    assert client_stats["bytes_put"] == result.bytes_written
    assert result.bytes_written == int(result.stored_blocks.sum()) * PAYLOAD
    assert client_stats["hits"] == result.verified_blocks == int(result.hit_blocks.sum())
    assert client_stats["corrupt_blocks"] == 0


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "prefix"])
def test_replay_smoke_under_pressure(work: Workload, policy: str) -> None:
    payloads = Payloads(PAYLOAD)
    blocks = max(64, work.working_set * 3 // 10)
    with Client.connect(_url(blocks, policy), namespace=work.namespace) as client:
        result = replay(client, work.chains, work.prompt_tokens, payloads, block_tokens=16)
        stats = client.stats()
        _check_totals(result, work, stats.as_dict())
        evictions = stats.store["evictions"]
    assert isinstance(evictions, int) and evictions > 0  # the capacity really was short
    assert 0 < result.total_hit_tokens < work.ideal_hit_tokens()
    assert result.total_hit_tokens <= work.belady_hit_tokens(blocks)


def test_replay_at_full_capacity_hits_everything_seen_before(work: Workload) -> None:
    with Client.connect(_url(work.working_set, "prefix"), namespace=work.namespace) as client:
        result = replay(client, work.chains, work.prompt_tokens, Payloads(PAYLOAD), block_tokens=16)
        _check_totals(result, work, client.stats().as_dict())
    assert (
        result.total_hit_tokens
        == work.ideal_hit_tokens()
        == work.belady_hit_tokens(work.working_set)
    )


def test_replay_with_an_ssd_tier(work: Workload, tmp_path: Path) -> None:
    slot = block_slot(PAYLOAD)
    url = (f"local://{tmp_path / 'store'}?dram={32 * slot}&max_value={slot}&slab={slot}"
           f"&prefault=0&policy=prefix&ssd={64 * (slot + 4096) * 4}&admit=1")  # fmt: skip
    with Client.connect(url, namespace=work.namespace) as client:
        result = replay(client, work.chains, work.prompt_tokens, Payloads(PAYLOAD),
                        block_tokens=16, count_ssd_hits=True)  # fmt: skip
        stats = client.stats()
        _check_totals(result, work, stats.as_dict())
        tiers = stats.store["tiers"]
    assert isinstance(tiers, tuple) and tiers[1]["hits"] == int(result.ssd_hits.sum()) > 0
    assert np.all(result.ssd_hits <= result.hit_blocks)


def test_a_wrong_block_fails_the_replay(work: Workload) -> None:
    """A store that serves different bytes under a key is caught, not counted as a hit."""
    payloads = Payloads(PAYLOAD)
    with Client.connect(_url(work.working_set, "lru"), namespace=work.namespace) as client:
        first = work.chains[0][0]
        wrong = payloads.of(first).copy()
        wrong[100] ^= 1
        client.put(first, wrong)
        with pytest.raises(CorruptBlockError, match="different bytes"):
            replay(client, work.chains, work.prompt_tokens, payloads, block_tokens=16)


def test_payload_stamps() -> None:
    p = Payloads(64)
    a, b = bytes(range(16)), bytes(range(1, 17))
    block = p.of(a).copy()
    assert p.matches(a, block) and not p.matches(b, block)
    block[30] ^= 0xFF
    assert not p.matches(a, block)
    with pytest.raises(ValueError):
        Payloads(8)


def test_ttft_model_formula() -> None:
    model, gpu = PROFILES["llama-3.1-8b"], ttft.GPUS["h100"]
    n, h = np.array([1000, 1000]), np.array([0, 992])
    got = ttft.prefill_seconds(model, gpu, n, h)
    flops0 = 2 * 8.03e9 * 1000 + 2 * 32 * 4096 * 1000**2
    assert got[0] == pytest.approx(flops0 / (989e12 * 0.5))
    assert 0 < got[1] < got[0] / 50
    costs = ttft.LoadCosts(dram_s=1e-3, ssd_s=5e-3)
    t = ttft.ttft_seconds(model, gpu, n, np.array([0, 62]), np.array([0, 2]), 16, costs, "all")
    assert t.seconds[0] == pytest.approx(got[0])
    load = 60 * 1e-3 + 2 * 5e-3 + 992 * 131_072 / 50e9
    assert t.seconds[1] == pytest.approx(got[1] + load)
    assert t.loaded_blocks.tolist() == [0, 62]
    seventy = PROFILES["llama-3.1-70b-tp8"]  # TP 8: the FLOPs spread over 8 GPUs
    single = ttft.prefill_seconds(seventy, gpu, n[:1], h[:1])[0]
    assert single == pytest.approx(
        (2 * 7.06e10 * 1000 + 2 * 80 * 8192 * 1000**2) / (8 * 989e12 * 0.5)
    )


def test_ttft_model_claims_only_hits_that_beat_recomputing() -> None:
    model, gpu = PROFILES["llama-3.1-8b"], ttft.GPUS["h100"]
    n = np.array([1000, 1000, 1000], dtype=np.int64)
    hits, ssd = np.array([62, 62, 62]), np.array([0, 62, 31])
    none = ttft.prefill_seconds(model, gpu, n, np.zeros_like(n))
    # recomputing a 16-token block here costs ~0.1 ms; DRAM loads cost 1 us, SSD loads 10 ms
    costs = ttft.LoadCosts(dram_s=1e-6, ssd_s=1e-2)
    every = ttft.ttft_seconds(model, gpu, n, hits, ssd, 16, costs, claim="all")
    chosen = ttft.ttft_seconds(model, gpu, n, hits, ssd, 16, costs)
    assert chosen.loaded_blocks.tolist() == [62, 0, 31]  # all DRAM; no SSD; the DRAM lead
    assert np.all(chosen.seconds <= none + 1e-12) and np.all(chosen.seconds <= every.seconds)
    assert every.seconds[1] > none[1]  # loading every SSD hit would have lost
    assert chosen.seconds[1] == pytest.approx(none[1])
    with pytest.raises(ValueError, match="claim"):
        ttft.ttft_seconds(model, gpu, n, hits, ssd, 16, costs, claim="some")


def test_ttft_model_claims_by_the_lookups_segments() -> None:
    """With the replay's tier segments the model claims up to a segment end: a hit whose SSD
    blocks lead is not mistaken for a DRAM lead."""
    model, gpu = PROFILES["llama-3.1-8b"], ttft.GPUS["h100"]
    n = np.array([1000, 1000, 1000, 1000], dtype=np.int64)
    hits, ssd = np.array([62, 62, 62, 0]), np.array([31, 31, 2, 0])
    costs = ttft.LoadCosts(dram_s=1e-6, ssd_s=1e-2)
    d, s = Tier.DRAM, Tier.SSD
    runs = [
        TierRun(((d, 31), (s, 31))),  # DRAM lead: loaded, the SSD part recomputed
        TierRun(((s, 31), (d, 31))),  # SSD lead: the DRAM part behind it cannot pay for it
        TierRun(((s, 2), (d, 60))),  # a short SSD lead: 60 cheap DRAM blocks pay for it
        TierRun(),
    ]
    chosen = ttft.ttft_seconds(model, gpu, n, hits, ssd, 16, costs, runs=runs)
    assert chosen.loaded_blocks.tolist() == [31, 0, 62, 0]
    none = ttft.prefill_seconds(model, gpu, n, np.zeros_like(n))
    assert np.all(chosen.seconds <= none + 1e-12)
    # The old assumption (DRAM first) would load 31 blocks of the second, half of them SSD.
    assert ttft.ttft_seconds(model, gpu, n, hits, ssd, 16, costs).loaded_blocks[1] == 31
    every = ttft.ttft_seconds(model, gpu, n, hits, ssd, 16, costs, claim="all", runs=runs)
    old = ttft.ttft_seconds(model, gpu, n, hits, ssd, 16, costs, claim="all")
    assert every.loaded_blocks.tolist() == [62, 62, 62, 0]
    assert every.seconds == pytest.approx(old.seconds)  # loading all costs the same either way


def test_ttft_model_with_layer_parts_overlaps_loading_and_computing() -> None:
    """With the KV in P layer parts a load overlaps compute: an SSD hit that costs exactly
    what recomputing it costs saves nothing whole, but about half the time when the hit is
    split so that loading and computing take as long."""
    model, gpu = PROFILES["llama-3.1-8b"], ttft.GPUS["h100"]
    n = np.array([16 * 64 + 1], dtype=np.int64)  # 64 hit blocks, one token computed after
    hits, ssd = np.array([64]), np.array([64])
    none = ttft.prefill_seconds(model, gpu, n, np.zeros_like(n))
    block_s = float(none[0]) / 64  # recomputing a block, about
    copy_s = 16 * model.bytes_per_token / gpu.h2d_bytes_per_s
    costs = ttft.LoadCosts(dram_s=1e-6, ssd_s=block_s - copy_s)
    runs = [TierRun(((Tier.SSD, 64),))]
    whole = ttft.ttft_seconds(model, gpu, n, hits, ssd, 16, costs, runs=runs)
    assert whole.seconds[0] == pytest.approx(none[0], rel=0.02)  # loading no better
    split = ttft.ttft_seconds(model, gpu, n, hits, ssd, 16, costs, runs=runs, parts=4)
    assert 20 <= split.loaded_blocks[0] <= 44  # about half loaded, half computed
    assert split.seconds[0] < 0.7 * none[0]
    assert split.seconds[0] <= whole.seconds[0]
    every = ttft.ttft_seconds(model, gpu, n, hits, ssd, 16, costs, claim="all", runs=runs,
                              parts=4)  # fmt: skip
    assert every.loaded_blocks[0] == 64 and every.seconds[0] > split.seconds[0]
    # The overlapped cost of k loaded blocks, at the split chosen.
    k = int(split.loaded_blocks[0])
    load = k * (costs.ssd_s + copy_s)
    compute = ttft.prefill_seconds(model, gpu, n, np.array([16 * k]))[0]
    assert split.seconds[0] == pytest.approx(max(load + compute / 4, load / 4 + compute))
    # Without tier runs the hit is DRAM first, as for whole blocks: all loaded (DRAM is cheap).
    cheap = ttft.ttft_seconds(model, gpu, n, hits, np.array([0]), 16, costs, parts=4)
    assert cheap.loaded_blocks[0] == 64


def test_trace_bench_end_to_end_without_peers_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "trace.json"
    trace_file = tmp_path / "used.jsonl"
    argv = ["bench", "trace", "--sessions", "3", "--capacities", "30,100", "--ssd-capacities",
            "100", "--dir", str(tmp_path), "--write-trace", str(trace_file), "--json", str(out),
            "--model", "smollm2-135m"]  # fmt: skip
    for name in ("KVOFFLOAD_VLLM_PYTHON", "KVOFFLOAD_LMCACHE_PYTHON"):  # not the peers' venvs
        monkeypatch.setenv(name, sys.executable)
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["bench"] == "trace"
    rows = {(r["case"], r["ref"]): r for r in data["rows"]}
    for policy in ("prefix", "s3fifo"):
        for pct in ("30%", "100%"):
            row = rows[(f"hit_tokens/{policy}/{pct}", "lru")]
            assert row["unit"] == "tokens" and row["value"] > 0 and row["ref_value"] > 0
            assert row["ratio"] == pytest.approx(row["value"] / row["ref_value"], abs=1e-3)
    for peer in ("vllm_lru", "vllm_arc", "lmcache"):
        row = rows[("hit_tokens/prefix/30%", peer)]
        if row["ref_value"] is None:  # peer not installed here: a row with a reason
            assert "not importable" in row["note"]
        assert ("hit_tokens/prefix+ssd/100%", peer) in rows
    assert "no disk tier" in rows[("hit_tokens/prefix+ssd/100%", "vllm_arc")]["note"]
    details = data["details"]
    runs = {(r["system"], r["tier"], r["percent"]): r for r in details["runs"]}
    full = runs[("prefix", "dram", 100)]
    assert full["hit_tokens"] == details["ideal_hit_tokens"]
    tiered = runs[("lru", "dram+ssd", 100)]
    assert 0 < tiered["dram_blocks"] < tiered["ssd_blocks"]
    assert full["ttft_model"]["h100"]["mean_ms"] > 0 < details["ttft_no_cache"]["h100"]["mean_ms"]
    assert details["load_costs"]["ssd_ms"] > 0 and trace_file.exists()
    realistic = runs[("lru", "dram10+ssd100", 110)]  # DRAM 10% + SSD 100% of the working set
    assert realistic["ssd_blocks"] == details["working_set_blocks"] > realistic["dram_blocks"]
    ttft_cases = {case: row for (case, ref), row in rows.items() if case.startswith("ttft_model/")}
    assert all(row["ref"] == "no_store" for row in ttft_cases.values())
    assert "ttft_model/lru+ssd/100%/smollm2-135m/h100" in ttft_cases
    assert "ttft_model/dram10+ssd100/smollm2-135m/h100" in ttft_cases  # the default policy
    worst = ttft_cases["ttft_model/worst"]
    assert worst["ratio"] == min(r["ratio"] for c, r in ttft_cases.items() if c.count("/") == 4)
    assert worst["ratio"] >= 1.0  # hits are claimed only where loading beats recomputing
    assert not list(tmp_path.glob("kvoffload-bench-trace-*"))  # scratch removed

    # the trace it wrote replays to the same hits
    again = tmp_path / "again.json"
    argv = ["bench", "trace", "--trace", str(trace_file), "--capacities", "100", "--tiers",
            "dram", "--policies", "prefix", "--peers", "", "--json", str(again),
            "--model", "smollm2-135m"]  # fmt: skip
    assert main(argv) == 0
    replayed = json.loads(again.read_text())["details"]["runs"][0]
    assert replayed["hit_tokens"] == full["hit_tokens"]


def test_trace_bench_against_a_url(tmp_path: Path) -> None:
    out = tmp_path / "url.json"
    url = "local://?dram=8MiB&max_value=4096&slab=4096&prefault=0&policy=prefix"
    assert main(["bench", "trace", "--url", url, "--sessions", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["details"]["url"] == url
    (run,) = data["details"]["runs"]
    assert run["system"] == "prefix" and run["hit_tokens"] > 0
    assert {r["ref"] for r in data["rows"]} <= {"lru", "no_store"}


@pytest.mark.integration
def test_trace_bench_against_a_live_daemon(tmp_path: Path, start_daemon: Any) -> None:
    daemon = start_daemon("--dram", "16MiB")
    out = tmp_path / "daemon.json"
    argv = ["bench", "trace", "--url", daemon.url(), "--sessions", "3", "--model",
            "smollm2-135m", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    (run,) = data["details"]["runs"]
    assert data["details"]["url"] == daemon.url() and run["hit_tokens"] > 0
    assert run["verified_blocks"] * data["details"]["block_tokens"] == run["hit_tokens"]


def test_peer_python_finds_the_engine_suites_venvs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoffload.bench import common
    from kvoffload.bench.trace import trace_bench as bench

    args = argparse.Namespace(vllm_python=None, lmcache_python=None)
    monkeypatch.setattr(common, "__file__", str(tmp_path / "bench" / "common.py"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVOFFLOAD_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("KVOFFLOAD_IGNORE_PEER_VENVS", raising=False)
    assert bench._peer_python("vllm_arc", args) == sys.executable
    python = tmp_path / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    assert bench._peer_python("vllm_arc", args) == str(python)
    # .ci/run's main suite, while the engines' environments are still being built
    monkeypatch.setenv("KVOFFLOAD_IGNORE_PEER_VENVS", "1")
    assert bench._peer_python("vllm_arc", args) == sys.executable
    monkeypatch.delenv("KVOFFLOAD_IGNORE_PEER_VENVS")
    monkeypatch.setenv("KVOFFLOAD_VLLM_PYTHON", "/env/python")
    assert bench._peer_python("vllm_lru", args) == "/env/python"
    args.vllm_python = "/flag/python"
    assert bench._peer_python("vllm_lru", args) == "/flag/python"


def test_bad_arguments_are_config_errors() -> None:
    trace = generate(TraceShape(sessions=1), seed=0)
    from kvoffload.bench.trace import trace_bench as bench

    with pytest.raises(ConfigError, match="policy"):
        bench.run(trace, policies=["mru"], peers=[])
    with pytest.raises(ConfigError, match="peer"):
        bench.run(trace, peers=["redis"])
    with pytest.raises(ConfigError, match="capacities"):
        bench.run(trace, percents=[0], peers=[])
    with pytest.raises(ConfigError, match="model"):
        bench.run(trace, model="gpt-5", peers=[])
    assert main(["bench", "trace", "--capacities", "ten"]) == 2


def test_peer_driver_reports_an_absent_peer(tmp_path: Path, work: Workload) -> None:
    work_file = _peer_work(work, tmp_path)
    out = tmp_path / "peer.json"
    driver = peer_driver.__file__
    # vllm made unimportable even where it is installed
    hide = (
        "import runpy, sys; sys.modules['vllm'] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    cmd = [
        sys.executable,
        "-c",
        hide,
        str(driver),
        str(work_file),
        str(out),
        "--peer",
        "vllm_arc",
        "--capacities",
        "10",
        "--block-tokens",
        "16",
        "--payload",
        "3968",
    ]
    subprocess.run(cmd, check=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["peer"] == "vllm_arc" and "not importable" in result["error"]
    assert result["runs"] == []


@pytest.mark.integration
@pytest.mark.parametrize(("peer", "env"), [("vllm_arc", "KVOFFLOAD_VLLM_PYTHON"),
                                           ("lmcache", "KVOFFLOAD_LMCACHE_PYTHON")])  # fmt: skip
def test_real_peer_on_a_small_trace(tmp_path: Path, work: Workload, peer: str, env: str) -> None:
    """Runs where a Python with the peer is named or found (`.venv-<package>`, as
    .ci/engines.sh builds them); KVOFFLOAD_REQUIRE_PEERS=1 (CI) turns a missing one into a
    failure."""
    from kvoffload.bench.trace import trace_bench as bench

    names = argparse.Namespace(vllm_python=None, lmcache_python=None)
    python = bench._peer_python(peer, names)
    if python == sys.executable:
        reason = f"neither {env} nor .venv-{bench.PEERS[peer][0]} names a Python with {peer}"
        if os.environ.get("KVOFFLOAD_REQUIRE_PEERS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    configs = plan(work.working_set, [30, 100], [peer], ["dram"])
    runs, info = _peer_runs(peer, python, configs, _peer_work(work, tmp_path), work,
                            PAYLOAD, tmp_path, 600)  # fmt: skip
    assert info["error"] is None and info["version"]
    low, full = runs
    assert low.hit_blocks is not None and full.hit_blocks is not None
    assert int(full.hit_blocks.sum()) * 16 == work.ideal_hit_tokens()
    assert int(low.hit_blocks.sum()) < int(full.hit_blocks.sum())


def test_write_jsonl_then_cli_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(generate(TraceShape(sessions=2), seed=3), path)
    out = tmp_path / "o.json"
    argv = ["bench", "trace", "--trace", str(path), "--seed", "3", "--capacities", "50",
            "--tiers", "dram", "--peers", "", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["details"]["trace"]["source"] == str(path)
