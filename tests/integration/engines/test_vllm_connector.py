"""KVOffloadConnector inside vLLM 0.33.0's real scheduler, against a live `kvoffload serve`.

Two requests share a 96-token prefix (6 blocks). The first computes it and the connector saves
it; the GPU prefix cache is then dropped and the KV memory scrambled, so the second request can
only get the prefix from the store: vLLM must see it as external tokens, and after the load
its KV pages must hold exactly the bytes that were saved. Loads that fail (a damaged block, a
store that went away between lookup and load) must end in recomputed, correct KV and a request
that finishes normally.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM")

import torch  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm_harness import BLOCK, Engine, write_tiny_model  # noqa: E402

from kvoffload.client_sdk import Client, Tier, TierRun, engine_hashes  # noqa: E402
from kvoffload.connectors.vllm import KVOffloadConnector  # noqa: E402
from kvoffload.connectors.vllm.claim import ClaimRule, load_batches  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402
from tests.conftest import Daemon  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PREFIX = list(range(1000, 1096))  # 6 full blocks
LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engines() -> Any:
    made: list[Engine] = []

    def make(*args: Any, **kwargs: Any) -> Engine:
        engine = Engine(*args, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def _save_first_request(engine: Engine) -> dict[int, torch.Tensor]:
    """Run r1 (prefix + 4 tokens) to completion; the pages of its 6 prefix blocks."""
    engine.add("r1", PREFIX + [5, 6, 7, 8])
    engine.step()
    seen = engine.seen["r1"]
    assert seen.first_computed == 0  # nothing stored yet
    saved = {i: engine.page(seen.table[i]) for i in range(len(PREFIX) // BLOCK)}
    engine.run()  # r1 finishes; its blocks are freed once the connector saved them
    assert seen.finish == FinishReason.LENGTH
    # Nothing may come from vLLM's own prefix cache or from leftovers in KV memory.
    assert engine.scheduler.reset_prefix_cache()
    engine.scramble()
    return saved


@pytest.mark.parametrize("layout", LAYOUTS)
def test_second_request_loads_the_shared_prefix_bit_exact(
    tiny_model: Path, start_daemon: Any, engines: Any, layout: str
) -> None:
    daemon = start_daemon()
    engine = engines(tiny_model, daemon.url(), layout)
    # Both halves came from vLLM's factory through kv_connector_module_path.
    assert isinstance(engine.scheduler.connector, KVOffloadConnector)
    assert isinstance(engine.worker, KVOffloadConnector)
    saved = _save_first_request(engine)

    engine.add("r2", PREFIX + [9, 9, 9])
    out = engine.step()
    # The scheduler found the prefix in the store and parked r2 while the worker loads it.
    assert "r2" not in out.num_scheduled_tokens
    engine.run()
    seen = engine.seen["r2"]
    assert seen.first_computed == len(PREFIX)  # 96 external tokens, only 3 computed
    assert seen.finish == FinishReason.LENGTH
    for index, page in saved.items():
        assert torch.equal(engine.page(seen.table[index]).view(torch.uint8),
                           page.view(torch.uint8)), f"block {index}"  # fmt: skip
    # And the loaded prefix is what the model computes for these tokens.
    assert torch.equal(engine.page(seen.table[5]).view(torch.uint8),
                       engine.expected_page(seen.tokens, 5).view(torch.uint8))  # fmt: skip

    # A prompt that is exactly the stored prefix: the last token is left to compute, so the
    # last block is not loaded (vLLM needs the logits of the last prompt token).
    engine.scheduler.reset_prefix_cache()
    engine.add("r3", list(PREFIX))
    engine.run()
    assert engine.seen["r3"].first_computed == len(PREFIX) - BLOCK


@pytest.mark.parametrize("sync_load_blocks", [-1, 6])
def test_small_loads_on_a_cpu_run_before_the_forward_that_reads_them(
    tiny_model: Path, start_daemon: Any, engines: Any, sync_load_blocks: int
) -> None:
    daemon = start_daemon()
    # -1: every load is synchronous on a CPU worker; 6: loads of up to 6 blocks are.
    engine = engines(tiny_model, daemon.url(), "LBNHC", sync_load_blocks=sync_load_blocks)
    saved = _save_first_request(engine)
    engine.add("r2", PREFIX + [9, 9, 9])
    out = engine.step()
    # Scheduled in the very step that loads its prefix: no step parked in
    # WAITING_FOR_REMOTE_KVS, and the forward found the loaded pages in place.
    assert out.num_scheduled_tokens.get("r2") == 3
    engine.run()
    seen = engine.seen["r2"]
    assert seen.first_computed == len(PREFIX)
    assert seen.finish == FinishReason.LENGTH
    for index, page in saved.items():
        assert torch.equal(engine.page(seen.table[index]).view(torch.uint8),
                           page.view(torch.uint8)), f"block {index}"  # fmt: skip


def test_larger_loads_than_sync_load_blocks_stay_asynchronous(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = engines(tiny_model, daemon.url(), "LBNHC", sync_load_blocks=5)
    _save_first_request(engine)
    engine.add("r2", PREFIX + [9])
    assert "r2" not in engine.step().num_scheduled_tokens  # 6 blocks: parked while loading
    engine.run()
    assert engine.seen["r2"].first_computed == len(PREFIX)


def test_a_corrupt_block_of_a_synchronous_load_is_recomputed(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = engines(tiny_model, daemon.url(), "LBNHC", sync_load_blocks=-1)
    _save_first_request(engine)
    key = engine_hashes(engine.worker.namespace, [engine.requests["r1"].block_hashes[3]])[0]
    damage_stored_block(daemon.url(), key, -7)
    engine.add("r2", PREFIX + [9, 9])
    engine.run()
    seen = engine.seen["r2"]
    assert seen.finish == FinishReason.LENGTH  # recomputed, not failed
    for index in range(len(PREFIX) // BLOCK):
        got = engine.page(seen.table[index]).view(torch.uint8)
        want = engine.expected_page(seen.tokens, index).view(torch.uint8)
        assert torch.equal(got, want), f"block {index} holds wrong KV"
    # The recomputed blocks were saved again: the next load is whole and bit exact.
    engine.scheduler.reset_prefix_cache()
    engine.scramble()
    engine.add("r3", PREFIX + [4])
    engine.run()
    _assert_recomputed(engine, "r3", loaded=6)


def test_blocks_saved_in_one_layout_load_in_another(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    layer_compact = engines(tiny_model, daemon.url(), "LBNHC")
    saved = _save_first_request(layer_compact)
    layer_compact.close()
    cross_layer = engines(tiny_model, daemon.url(), "BLHNC")
    cross_layer.add("r2", PREFIX + [9])
    cross_layer.run()
    seen = cross_layer.seen["r2"]
    assert seen.first_computed == len(PREFIX)
    for index, page in saved.items():
        got = cross_layer.page(seen.table[index]).view(torch.uint8)
        assert torch.equal(got, page.view(torch.uint8)), f"block {index}"


def _assert_recomputed(engine: Engine, req_id: str, loaded: int) -> None:
    seen = engine.seen[req_id]
    assert seen.first_computed == loaded * BLOCK
    assert seen.finish == FinishReason.LENGTH  # recomputed, not failed
    for index in range(len(PREFIX) // BLOCK):
        got = engine.page(seen.table[index]).view(torch.uint8)
        want = engine.expected_page(seen.tokens, index).view(torch.uint8)
        assert torch.equal(got, want), f"block {index} holds wrong KV"


def test_a_corrupt_block_is_recomputed_from_there_on(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = engines(tiny_model, daemon.url(), "LBNHC")
    _save_first_request(engine)
    # Damage one payload byte of the 4th stored block, behind the SDK's back.
    key = engine_hashes(engine.worker.namespace, [engine.requests["r1"].block_hashes[3]])[0]
    damage_stored_block(daemon.url(), key, -7)

    engine.add("r2", PREFIX + [9, 9])
    engine.run()
    # Blocks 0-2 loaded; the damaged block and the ones after it were recomputed.
    _assert_recomputed(engine, "r2", loaded=3)

    # The recomputed blocks were saved again: a third request loads the whole prefix.
    engine.scheduler.reset_prefix_cache()
    engine.scramble()
    engine.add("r3", PREFIX + [4])
    engine.run()
    _assert_recomputed(engine, "r3", loaded=6)


def test_a_store_that_goes_away_before_the_load_means_recompute(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = engines(tiny_model, daemon.url(retries="1", timeout="5"), "BLNHC")
    _save_first_request(engine)
    engine.add("r2", PREFIX + [9, 9])
    out = engine.schedule()  # the lookup finds 6 blocks; the load is planned
    assert "r2" not in out.num_scheduled_tokens
    daemon.stop()
    engine.execute(out)  # the load fails: the store is gone
    engine.run()
    _assert_recomputed(engine, "r2", loaded=0)
    # With the store down, lookups answer "nothing stored" and requests simply compute.
    engine.scheduler.reset_prefix_cache()
    engine.add("r3", PREFIX + [4])
    engine.run()
    _assert_recomputed(engine, "r3", loaded=0)


def test_bad_extra_config_is_refused(tiny_model: Path, engines: Any) -> None:
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config"):
        engines(tiny_model, "kv://127.0.0.1:9", "LBNHC", batch=3)
    with pytest.raises(ConfigError, match="batch_blocks"):
        engines(tiny_model, "kv://127.0.0.1:9", "LBNHC", batch_blocks=0)
    with pytest.raises(ConfigError, match="claim"):
        engines(tiny_model, "kv://127.0.0.1:9", "LBNHC", claim="some")
    with pytest.raises(ConfigError, match="negative"):
        engines(tiny_model, "kv://127.0.0.1:9", "LBNHC", prefill_tokens_per_s=-1)
    with pytest.raises(ConfigError, match="sync_load_blocks"):
        engines(tiny_model, "kv://127.0.0.1:9", "LBNHC", sync_load_blocks=-2)


def test_hits_that_load_slower_than_they_compute_are_recomputed(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    # Told rates: the store delivers 16 tokens/s, the model computes a million.
    engine = engines(tiny_model, daemon.url(), "LBNHC", load_blocks_per_s=1,
                     prefill_tokens_per_s=1_000_000, claim="cost")  # fmt: skip
    _save_first_request(engine)
    engine.add("r2", PREFIX + [9, 9])
    out = engine.step()
    assert "r2" in out.num_scheduled_tokens  # not parked waiting for a load
    engine.run()
    _assert_recomputed(engine, "r2", loaded=0)
    claim = engine.scheduler.connector._sched().claim
    assert claim.skipped_tokens == len(PREFIX)

    # The same store and rates with claim="all": every hit is loaded, as before.
    engine.close()
    every = engines(tiny_model, daemon.url(), "LBNHC", load_blocks_per_s=1,
                    prefill_tokens_per_s=1_000_000, claim="all")  # fmt: skip
    every.add("r3", PREFIX + [4])
    every.run()
    assert every.seen["r3"].first_computed == len(PREFIX)


def test_workers_measure_the_rates_the_scheduler_claims_by(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = engines(tiny_model, daemon.url(), "LBNHC", claim="cost")
    claim = engine.scheduler.connector._sched().claim
    assert claim.load_blocks_per_s is None and claim.prefill_tokens_per_s is None
    _save_first_request(engine)  # r1 computes 100 tokens on the CPU worker
    prefill = claim.prefill_tokens_per_s
    assert prefill is not None and prefill > 0
    assert claim.load_blocks_per_s is None  # nothing loaded yet: every hit is claimed
    engine.add("r2", PREFIX + [9, 9])
    engine.run()
    assert engine.seen["r2"].first_computed == len(PREFIX)
    load = claim.load_blocks_per_s
    assert load is not None and load > 0
    # From now on the measured rates decide (this harness's synthetic forward is far cheaper
    # than loading, so whichever way: the decision follows the rates it measured).
    engine.scheduler.reset_prefix_cache()
    loads = load * BLOCK > claim.prefill_tokens_per_s
    engine.add("r3", PREFIX + [4])
    engine.run()
    assert engine.seen["r3"].first_computed == (len(PREFIX) if loads else 0)
    assert claim.skipped_tokens == (0 if loads else len(PREFIX))
    # What the workers reported is what vLLM's logger can rebuild and reduce.
    stats = KVOffloadConnector.build_kv_connector_stats(
        {"load_blocks": 6.0, "load_s": 0.5, "prefill_tokens": 100.0, "prefill_s": 0.25}
    )
    assert stats.reduce() == {"loaded_blocks": 6, "load_blocks_per_s": 12.0,
                              "prefill_tokens_per_s": 400.0}  # fmt: skip
    assert not stats.is_empty() and KVOffloadConnector.build_kv_connector_stats().is_empty()


def test_the_prefill_rate_counts_the_forward_when_loads_start_after_it(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    # Without synchronous loads vLLM calls start_load_kv after the forward: the measured
    # compute time must still cover the forward (it starts when vLLM binds the step's plan).
    daemon = start_daemon()
    engine = engines(tiny_model, daemon.url(), "LBNHC", claim="cost")
    forward = engine._forward

    def slow_forward(out: Any) -> dict[str, list[int]]:
        time.sleep(0.25)  # a forward that takes at least this long
        return forward(out)

    engine._forward = slow_forward
    engine.add("r1", PREFIX + [5, 6, 7, 8])
    engine.step()  # computes the 100 prompt tokens in one forward
    rate = engine.scheduler.connector._sched().claim.prefill_tokens_per_s
    assert rate is not None and rate <= 100 / 0.25


def test_saved_blocks_carry_their_token_ids_into_the_store_s_events(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    import msgpack
    import zmq

    replay_env = {"KVOFFLOAD_EVENTS__REPLAY_ENDPOINT": "tcp://127.0.0.1:*"}
    daemon = start_daemon("--events", "tcp://127.0.0.1:*", env=replay_env)
    (replay,) = [line.rsplit(" ", 1)[1] for line in daemon.lines if "events replay on" in line]
    engine = engines(tiny_model, daemon.url(), LAYOUTS[0])
    _save_first_request(engine)
    asker = zmq.Context.instance().socket(zmq.DEALER)
    asker.connect(replay)
    asker.send_multipart([b"", bytes(8)])
    stored: list[dict[str, Any]] = []
    while True:
        assert asker.poll(20_000), "no replay answer"
        _, seq, payload = asker.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        stored += [e for e in msgpack.unpackb(payload)[1] if e["type"] == "BlockStored"]
    asker.close(linger=0)
    blocks = len(PREFIX) // BLOCK
    by_tokens = {tuple(e["token_ids"]): e for e in stored}
    chain = [by_tokens[tuple(PREFIX[i * BLOCK : (i + 1) * BLOCK])] for i in range(blocks)]
    assert all(e["block_size"] == BLOCK for e in chain)
    # vLLM's chained hashes, as its own events publish them: each block names its parent.
    assert chain[0]["parent_block_hash"] is None
    for parent, child in zip(chain, chain[1:], strict=False):
        assert child["parent_block_hash"] == parent["block_hashes"][0]


# ---------------------------------------------------------------------------- claims per tier

D, S = Tier.DRAM, Tier.SSD


def test_the_rule_claims_up_to_the_best_tier_segment_end() -> None:
    rule = ClaimRule(16, "cost", prefill_tokens_per_s=1600.0)  # a block recomputes in 10 ms
    mixed = TierRun(((D, 3), (S, 3)))
    assert rule.claim_blocks(mixed) == 6  # no load rate known yet: load, and measure
    rule.observe({"load_blocks_dram": 10.0, "load_s_dram": 0.01})  # 1 ms per block
    rule.observe({"load_blocks_ssd": 1.0, "load_s_ssd": 0.1})  # 100 ms per block
    assert rule.claim_blocks(mixed) == 3 and rule.skipped_tokens == 3 * 16
    assert rule.claim_blocks(TierRun(((S, 3), (D, 3)))) == 0  # an SSD lead never pays off
    # A short SSD part behind a long DRAM lead, then DRAM again: the DRAM after it pays.
    assert rule.claim_blocks(TierRun(((D, 40), (S, 1), (D, 40)))) == 81
    assert rule.claim_blocks(TierRun()) == 0
    told = ClaimRule(16, "cost", load_blocks_per_s=1e6, prefill_tokens_per_s=1600.0)
    assert told.claim_blocks(TierRun(((S, 5),))) == 5  # a told rate stands for every tier
    assert ClaimRule(16, "all", 1.0, 1e9).claim_blocks(mixed) == 6
    # A batch never mixes tiers, so its time measures one tier's rate.
    assert load_batches(7, 2, TierRun(((D, 3), (S, 2)))) == [
        (0, 2, D), (2, 3, D), (3, 5, S), (5, 7, Tier.UNKNOWN)
    ]  # fmt: skip


def test_with_layer_parts_the_rule_splits_the_hit_where_loading_hides_under_compute() -> None:
    # A block recomputes in 10 ms and loads from the SSD in 10 ms: without overlap loading it
    # saves nothing; with 4 layer parts the first k blocks load while the rest compute.
    ssd = {"load_blocks_ssd": 1.0, "load_s_ssd": 0.01}
    whole, parts = ClaimRule(16, "cost", 0.0, 1600.0), ClaimRule(16, "cost", 0.0, 1600.0, parts=4)
    for rule in (whole, parts):
        rule.observe(ssd)
    hit = TierRun(((S, 8),))
    assert whole.claim_blocks(hit) == 0
    # max(10k + 10(8-k)/4, 10k/4 + 10(8-k)) is least at k = 4: 50 ms against 80 recomputing.
    assert parts.claim_blocks(hit) == 4
    assert parts.skipped_tokens == 4 * 16
    # Tokens computed after the hit give loads more to hide under: all 8 blocks then.
    assert parts.claim_blocks(hit, after_tokens=16 * 8) == 8
    # Slow loads (100 ms a block) still never pay.
    slow = ClaimRule(16, "cost", 0.0, 1600.0, parts=4)
    slow.observe({"load_blocks_ssd": 1.0, "load_s_ssd": 0.1})
    assert slow.claim_blocks(TierRun(((S, 4),))) == 0
    with pytest.raises(ValueError):
        ClaimRule(16, parts=0)


def test_hits_are_claimed_per_tier_with_the_real_scheduler(
    tiny_model: Path, tmp_path: Path, engines: Any
) -> None:
    """A daemon holds the prefix's first 3 blocks in DRAM and the last 3 only on its SSD; with
    SSD loads measured slower than recomputing, the scheduler claims the DRAM lead only (its
    pages load bit-exact, the rest is recomputed); once the SSD measures fast, all of it."""
    home = tmp_path / "node"
    home.mkdir()
    first = Daemon(home, "--ssd", "64MiB")
    try:
        engine = engines(tiny_model, first.url(), "LBNHC")
        _save_first_request(engine)
        ns = engine.worker.namespace
        keys = engine_hashes(ns, engine.requests["r1"].block_hashes[:6])
        with Client.connect(first.url(), namespace=ns) as client:  # made durable: on the SSD
            for key in keys:
                client.put(key, client.get(key), durable=True)
        engine.close()
    finally:
        first.stop()
    second = Daemon(home, "--ssd", "64MiB")  # restarted: its DRAM is cold
    try:
        with Client.connect(second.url(), namespace=ns) as client:
            for key in keys[:3]:
                assert client.get(key) is not None  # read: now in DRAM too
            assert client.lookup(keys, tiers=True) == TierRun(((D, 3), (S, 3)))
        engine = engines(tiny_model, second.url(), "LBNHC", claim="cost",
                         prefill_tokens_per_s=1600.0)  # fmt: skip
        claim = engine.scheduler.connector._sched().claim
        claim.observe({"load_blocks_dram": 10.0, "load_s_dram": 0.01,
                       "load_blocks_ssd": 1.0, "load_s_ssd": 100.0})  # fmt: skip
        engine.add("r2", PREFIX + [9, 9])
        engine.run()
        _assert_recomputed(engine, "r2", loaded=3)
        assert claim.skipped_tokens == 3 * BLOCK
        # The workers measured their DRAM batches (and no SSD one: none was loaded).
        assert claim.tier_blocks_per_s(D) != 1000.0
        assert claim.tier_blocks_per_s(S) == 0.01
        for _ in range(40):  # SSD loads now measured fast (the average follows)
            claim.observe({"load_blocks_ssd": 1000.0, "load_s_ssd": 0.01})
        engine.scheduler.reset_prefix_cache()
        engine.scramble()
        engine.add("r3", PREFIX + [4])
        engine.run()
        _assert_recomputed(engine, "r3", loaded=6)
        assert claim.skipped_tokens == 3 * BLOCK
    finally:
        second.stop()
