"""Blocks stored as layer parts (`layer_parts`), loaded layer by layer inside vLLM 0.33.0's real
scheduler and worker lifecycle, against a live `kvoffload serve`.

The tiny model has 6 layers stored in 4 parts (2, 2, 1 and 1 layers). A second request finds
its prefix in the store and runs in the very step that loads it: the harness's forward calls
`wait_for_layer_load` for each layer in model order, and each layer must then already hold the
saved bytes. A part missing or damaged in the store, or a load that outlives its timeout, must
end in that block and the ones after it reported to vLLM, which discards the step's output of
the request and recomputes from there: never a hang, never an unverified byte in the KV cache.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM")

import torch  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm_harness import BLOCK, Engine, write_tiny_model  # noqa: E402

from kvoffload.client_sdk import Client, Namespace, engine_hashes  # noqa: E402
from kvoffload.connectors.paged_kv import CANONICAL_LAYOUT  # noqa: E402
from kvoffload.connectors.vllm import KVOffloadConnector, _compat  # noqa: E402
from kvoffload.connectors.vllm.layers import part_groups, part_layout, split_layers  # noqa: E402
from kvoffload.connectors.vllm.plan import KVGroup, Settings, namespace_for  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

LAYERS = 6
PARTS = 4
PREFIX = list(range(2000, 2096))  # 6 full blocks
BLOCKS = len(PREFIX) // BLOCK


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-6"), LAYERS)


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


def _layered(make: Any, model: Path, url: str, layout: str = "LBNHC", **extra: Any) -> Engine:
    return make(model, url, layout, layers=LAYERS, layer_parts=PARTS, **extra)  # type: ignore[no-any-return]


def _save_first_request(engine: Engine) -> dict[int, torch.Tensor]:
    """r1 computes the prefix (+4 tokens); its 6 prefix pages; then vLLM's own prefix cache
    is dropped and KV memory scrambled, so only the store can serve the prefix."""
    engine.add("r1", PREFIX + [5, 6, 7, 8])
    engine.step()
    seen = engine.seen["r1"]
    assert seen.first_computed == 0
    saved = {i: engine.page(seen.table[i]) for i in range(BLOCKS)}
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    engine.scramble()
    return saved


def _part_keys(engine: Engine, part: int, req_id: str = "r1") -> list[bytes]:
    ns = engine.worker._work()._groups[part].namespace
    return engine_hashes(ns, engine.requests[req_id].block_hashes[:BLOCKS])


def _assert_correct_kv(engine: Engine, req_id: str) -> None:
    seen = engine.seen[req_id]
    assert seen.finish == FinishReason.LENGTH  # recomputed, not failed
    for index in range(BLOCKS):
        got = engine.page(seen.table[index]).view(torch.uint8)
        want = engine.expected_page(seen.tokens, index).view(torch.uint8)
        assert torch.equal(got, want), f"block {index} holds wrong KV"


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_four_layer_parts_load_layer_by_layer_bit_exact(
    six_layers: Path, start_daemon: Any, engines: Any, layout: str
) -> None:
    daemon = start_daemon()
    engine = _layered(engines, six_layers, daemon.url(), layout)
    saved = _save_first_request(engine)
    # Each part is its own value under its own key; no whole block was stored.
    keys = [_part_keys(engine, p) for p in range(PARTS)]
    assert len({k for part in keys for k in part}) == PARTS * BLOCKS
    with Client.connect(daemon.url()) as client:
        for p, part in enumerate(keys):
            assert client.lookup(part) == BLOCKS, f"part {p}"

    engine.add("r2", PREFIX + [9, 9, 9])
    order: list[str] = []

    def check(name: str) -> None:
        # After wait_for_layer_load(name) the layer already holds the saved bytes.
        order.append(name)
        layer = engine.layer_names.index(name)
        table = engine.seen["r2"].table
        for index, page in saved.items():
            got = engine.kv[name][table[index]].view(torch.uint8)
            assert torch.equal(got, page[layer].view(torch.uint8)), f"{name} block {index}"

    engine.on_layer = check
    out = engine.step()
    engine.on_layer = None
    # Loaded in the step that runs the request: no step parked waiting for the load.
    assert out.num_scheduled_tokens.get("r2") == 3
    assert order == engine.layer_names
    engine.run()
    seen = engine.seen["r2"]
    assert seen.starts == [len(PREFIX)]
    assert seen.finish == FinishReason.LENGTH
    for index, page in saved.items():
        assert torch.equal(engine.page(seen.table[index]).view(torch.uint8),
                           page.view(torch.uint8)), f"block {index}"  # fmt: skip
    # The loader measured whole blocks (every part) per second.
    claim = engine.scheduler.connector._sched().claim
    assert claim.load_blocks_per_s is not None


def test_one_layer_part_keeps_the_keys_of_whole_blocks(
    tiny_model_2: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = engines(tiny_model_2, daemon.url(), "LBNHC", layer_parts=1)
    engine.add("r1", PREFIX + [5])
    engine.run()
    geometry = _compat.geometry(engine.config, engine.kv_config)
    (group,) = geometry.groups
    # The namespace every release before layer parts computed its keys with.
    before = namespace_for(
        model=geometry.model, revision=geometry.revision, dtype=group.dtype,
        block_tokens=geometry.block_tokens, num_layers=len(group.layer_names),
        num_kv_heads=group.num_kv_heads, head_width=group.head_width,
        layout=CANONICAL_LAYOUT, tp_rank=0, tp_size=1, hash_algo=geometry.hash_algo, salt="",
    )  # fmt: skip
    assert engine.worker.namespace == before
    assert before.layout == "vllm:LNHC"
    keys = engine_hashes(before, engine.requests["r1"].block_hashes[:BLOCKS])
    with Client.connect(daemon.url()) as client:
        assert client.lookup(keys) == BLOCKS


@pytest.fixture(scope="module")
def tiny_model_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-2"))


def test_a_part_deleted_between_lookup_and_load_is_recomputed(
    six_layers: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = _layered(engines, six_layers, daemon.url())
    _save_first_request(engine)
    engine.add("r2", PREFIX + [9, 9])
    out = engine.schedule()  # the lookup finds all 6 blocks in every part
    assert out.num_scheduled_tokens.get("r2") == 2
    with Client.connect(daemon.url()) as client:
        assert client.delete(_part_keys(engine, 2)[3])
    engine.execute(out)  # part 2 of block 3 is missing: blocks 3-5 are reported
    request = engine.requests["r2"]
    assert not request.output_token_ids  # vLLM discarded what the step computed for r2
    engine.run()
    seen = engine.seen["r2"]
    # Rescheduled from the first failed block; its one output token came from that run.
    assert seen.starts == [len(PREFIX), 3 * BLOCK]
    assert list(request.output_token_ids) == [3]
    _assert_correct_kv(engine, "r2")
    # The recomputed blocks were saved again: the next load is whole and in one step.
    engine.scheduler.reset_prefix_cache()
    engine.scramble()
    engine.add("r3", PREFIX + [4])
    engine.run()
    assert engine.seen["r3"].starts == [len(PREFIX)]
    _assert_correct_kv(engine, "r3")


def test_a_damaged_part_is_never_scattered_and_is_recomputed(
    six_layers: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = _layered(engines, six_layers, daemon.url())
    saved = _save_first_request(engine)
    # One payload byte of part 1 (layers 2-3) of block 3, behind the SDK's back: it lies in
    # layer 3's last bytes.
    damage_stored_block(daemon.url(), _part_keys(engine, 1)[3], -7)
    layer3 = engine.layer_names[3]
    before = engine.kv[layer3].clone()  # scrambled memory, before r2's load
    engine.add("r2", PREFIX + [9, 9])
    held: list[tuple[torch.Tensor, torch.Tensor]] = []

    def look(name: str) -> None:
        if name == layer3 and not held:
            block = engine.seen["r2"].table[3]
            held.append((engine.kv[name][block].clone(), before[block]))

    engine.on_layer = look
    engine.run()
    # What the forward found in layer 3 of block 3 is the memory as it was: neither the
    # damaged bytes nor the zeros of a failed read were scattered there.
    ((found, untouched),) = held
    assert torch.equal(found.view(torch.uint8), untouched.view(torch.uint8))
    assert not torch.equal(found.view(torch.uint8), saved[3][3].view(torch.uint8))
    seen = engine.seen["r2"]
    assert seen.starts == [len(PREFIX), 3 * BLOCK]
    _assert_correct_kv(engine, "r2")


def test_a_failed_part_is_reported_with_its_step_when_wait_for_save_comes_later(
    six_layers: Path, start_daemon: Any, engines: Any
) -> None:
    """With speculative decoding vLLM takes a step's failed blocks before `wait_for_save`
    (which runs after the drafter): the layer-wise load is joined there too, so the step that
    read the bad part is discarded, not the next one."""
    daemon = start_daemon()
    engine = _layered(engines, six_layers, daemon.url())
    _save_first_request(engine)
    damage_stored_block(daemon.url(), _part_keys(engine, 1)[3], -7)
    engine.add("r2", PREFIX + [9, 9])
    engine.execute(engine.schedule(), defer_finalize=True)
    assert engine.seen["r2"].finish is None  # its token of that step was not kept
    engine.run()
    assert engine.seen["r2"].starts == [len(PREFIX), 3 * BLOCK]
    _assert_correct_kv(engine, "r2")


def test_loads_during_the_step_are_refused_under_async_scheduling(
    six_layers: Path, start_daemon: Any, engines: Any
) -> None:
    """vLLM's async scheduling plans step N+1 before step N's failed loads are known, so a
    request sharing the prefix could read blocks loaded during step N that failed: layer
    parts and explicit synchronous loads need it off; by default loads stay asynchronous."""
    daemon = start_daemon()
    for extra in ({"layer_parts": PARTS}, {"sync_load_blocks": 4}):
        with pytest.raises(ConfigError, match="--no-async-scheduling"):
            engines(six_layers, daemon.url(), "LBNHC", layers=LAYERS, async_scheduling=True,
                    **extra)  # fmt: skip
    engine = engines(six_layers, daemon.url(), "LBNHC", layers=LAYERS, async_scheduling=True)
    assert engine.scheduler.connector._sched()._sync_blocks == 0


def test_a_store_that_goes_away_before_a_layered_load_means_recompute(
    six_layers: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = _layered(engines, six_layers, daemon.url(retries="1", timeout="5"))
    _save_first_request(engine)
    engine.add("r2", PREFIX + [9, 9])
    out = engine.schedule()
    daemon.stop()
    engine.execute(out)
    engine.run()
    assert engine.seen["r2"].starts == [len(PREFIX), 0]
    _assert_correct_kv(engine, "r2")


def test_a_layer_load_past_its_timeout_is_reported_and_never_hangs(
    six_layers: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = _layered(engines, six_layers, daemon.url(timeout="60"), layer_load_timeout_s=0.5)
    _save_first_request(engine)
    engine.add("r2", PREFIX + [9, 9])
    out = engine.schedule()
    # The store stops answering: the loader's read blocks far past the layer-load timeout.
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        engine.execute(out)  # returns: the wait gave up, every block of r2 is reported
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert not engine.requests["r2"].output_token_ids
    engine.run()
    # Recomputed from its first block; the loader, cancelled, wrote nothing after the fact.
    assert engine.seen["r2"].starts == [len(PREFIX), 0]
    _assert_correct_kv(engine, "r2")


# ------------------------------------------------------------------------- split and settings


def test_layers_split_into_contiguous_parts_differing_by_at_most_one() -> None:
    assert split_layers(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert split_layers(32, 4) == [range(i, i + 8) for i in range(0, 32, 8)]
    assert split_layers(30, 1) == [range(0, 30)]
    for layers in range(1, 40):
        for parts in range(1, layers + 1):
            split = split_layers(layers, parts)
            sizes = [len(r) for r in split]
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == layers
            assert all(a.stop == b.start for a, b in zip(split, split[1:], strict=False))
    with pytest.raises(ConfigError, match="more than the model's 6 layers"):
        split_layers(6, 7)
    with pytest.raises(ConfigError):
        split_layers(6, 0)
    assert part_layout("vllm:LNHC", 0, 1, range(0, 6)) == "vllm:LNHC"
    assert part_layout("vllm:LNHC", 2, 4, range(4, 5)) == "vllm:LNHC;part=2/4;layers=4-4"
    group = KVGroup(tuple(f"l{i}" for i in range(5)), 2, 16, "float16")
    assert [g.layer_names for g in part_groups(group, 2)] == [("l0", "l1", "l2"), ("l3", "l4")]


def test_layer_part_namespaces_never_answer_for_each_other() -> None:
    base = dict(model="m", block_tokens=16, num_kv_heads=2, head_size=16, hash_algo="vllm:sha256")
    whole = Namespace(num_layers=6, layout="vllm:LNHC", **base)  # type: ignore[arg-type]
    parts = [Namespace(num_layers=len(r), layout=part_layout("vllm:LNHC", i, 4, r),
                       **base)  # type: ignore[arg-type]
             for i, r in enumerate(split_layers(6, 4))]  # fmt: skip
    keys = {bytes(engine_hashes(ns, [bytes(32)])[0]) for ns in [whole, *parts]}
    assert len(keys) == 5


def test_layer_part_settings_are_checked(six_layers: Path, engines: Any) -> None:
    url = {"url": "kv://127.0.0.1:9"}
    assert Settings.from_extra_config(url).layer_parts == 1
    assert Settings.from_extra_config({**url, "layer_parts": 4}).layer_parts == 4
    with pytest.raises(ConfigError, match="layer_parts"):
        Settings.from_extra_config({**url, "layer_parts": 0})
    with pytest.raises(ConfigError, match="layer_load_timeout_s"):
        Settings.from_extra_config({**url, "layer_load_timeout_s": 0})
    with pytest.raises(ConfigError, match="more than the model's 6 layers"):
        engines(six_layers, "kv://127.0.0.1:9", "LBNHC", layers=LAYERS, layer_parts=7)
    # Layer-wise waits need Python between layers: vLLM then captures piecewise CUDA graphs.
    assert KVOffloadConnector.requires_piecewise_for_cudagraph({"layer_parts": 4})
    assert not KVOffloadConnector.requires_piecewise_for_cudagraph({})
