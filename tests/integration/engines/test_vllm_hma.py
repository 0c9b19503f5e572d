"""KVOffloadConnector on a hybrid-attention model inside vLLM's real scheduler (`SupportsHMA`).

The model has two KV cache groups, as vLLM's hybrid KV cache manager builds them for a
Gemma-style model: full-attention layers 0 and 2, and sliding-window layers 1 and 3 (a window
of 32 tokens, two blocks) whose pages overlay the full-attention ones in the same memory, as
vLLM lays them out (a block id belongs to one group at a time). One engine computes a prompt
and saves every group's blocks; a fresh scheduler and worker must then load the shared prefix
from the store, bit-exact per group, the sliding-window group only inside its window.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm_harness import (  # noqa: E402
    BLOCK,
    HEAD,
    HEADS,
    NUM_BLOCKS,
    Engine,
    Seen,
    make_configs,
    make_scheduler,
    model_kv,
    write_tiny_model,
)

from kvoffload.client_sdk import Client, engine_hashes  # noqa: E402
from kvoffload.connectors.vllm import KVOffloadConnector  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WINDOW = 2 * BLOCK  # sliding window, tokens
FULL = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
SLIDING = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
GROUPS = [FULL, SLIDING]
LAYER_INDEX = {name: int(name.split(".")[2]) for name in FULL + SLIDING}
PREFIX = list(range(2000, 2096))  # 6 full blocks
# Blocks of the window ending after block 6: vLLM skips (96 - 32 + 1) // 16 = 4 blocks.
WINDOW_BLOCKS = (4, 5)


class HybridEngine(Engine):
    """`Engine` with two KV cache groups: full attention and a sliding window."""

    def __init__(self, model_dir: Path, url: str, chunk: int = 0, **extra: Any) -> None:
        transfer = KVTransferConfig(
            kv_connector="KVOffloadConnector",
            kv_connector_module_path="kvoffload.connectors.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"url": url, "batch_blocks": 4, "claim": "all", **extra},
        )
        self.config, _, full = make_configs(model_dir, "LBNHC", transfer)
        sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                                    dtype=torch.float16, sliding_window=WINDOW)  # fmt: skip
        page = full.page_size_bytes
        assert sliding.page_size_bytes == page
        # One tensor per group over the same bytes: layer i of each group shares memory.
        tensors = [KVCacheTensor(size=page * NUM_BLOCKS * 2, layers=layers,
                                 layer_stride=page * NUM_BLOCKS, block_stride=page)
                   for layers in GROUPS]  # fmt: skip
        self.kv_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=tensors,
            kv_cache_groups=[KVCacheGroupSpec(FULL, full), KVCacheGroupSpec(SLIDING, sliding)],
        )
        self.config.scheduler_config.disable_hybrid_kv_cache_manager = False
        if chunk:  # tokens per step: prompts longer than this are prefilled in chunks
            self.config.scheduler_config.max_num_batched_tokens = chunk
        self.scheduler = make_scheduler(self.config, self.kv_config)
        self.worker = KVConnectorFactory.create_connector(
            config=self.config, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_config
        )
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        self.raw = torch.zeros(tensors[0].size, dtype=torch.int8)
        self.kv = {}
        for spec, tensor in zip((full, sliding), tensors, strict=True):
            views = create_kv_cache_views(
                self.raw, spec, NUM_BLOCKS, KVCacheLayout["LBNHC"], tensor
            )
            self.kv.update(zip(tensor.layers, views, strict=True))
        self.worker.register_kv_caches(self.kv)
        self.seen: dict[str, Seen] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.requests = {}

    def _forward(self, out: Any) -> dict[str, list[int]]:
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self.seen[new.req_id].table = self.tables[new.req_id][0]
            computed[new.req_id] = new.num_computed_tokens
            if self.seen[new.req_id].first_computed is None:
                self.seen[new.req_id].first_computed = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                for table, ids in zip(self.tables[req_id], new_ids, strict=True):
                    table.extend(ids)
            computed[req_id] = cached.num_computed_tokens[i]
        sampled: dict[str, list[int]] = {}
        for req_id, count in out.num_scheduled_tokens.items():
            seen = self.seen[req_id]
            start = computed[req_id]
            for pos in range(start, min(start + count, len(seen.tokens))):
                offset = pos % BLOCK
                for table, layers in zip(self.tables[req_id], GROUPS, strict=True):
                    block = table[pos // BLOCK]
                    assert block != 0, f"{req_id}: computing position {pos} into the null block"
                    for name in layers:
                        kv = model_kv(LAYER_INDEX[name], seen.tokens[: pos + 1])
                        self.kv[name][block, :, offset, :] = kv
            sampled[req_id] = [3] if start + count >= len(seen.tokens) else []
        return sampled

    def group_page(self, group: int, block_id: int) -> torch.Tensor:
        """Block `block_id` of every layer of `group`, as bytes."""
        pages = [self.kv[name][block_id] for name in GROUPS[group]]
        return torch.stack(pages).clone().view(torch.uint8)

    def expected_group_page(self, group: int, tokens: list[int], index: int) -> torch.Tensor:
        layers = GROUPS[group]
        page = torch.empty((len(layers), HEADS, BLOCK, 2 * HEAD), dtype=torch.float16)
        for offset in range(BLOCK):
            pos = index * BLOCK + offset
            for i, name in enumerate(layers):
                page[i, :, offset, :] = model_kv(LAYER_INDEX[name], tokens[: pos + 1])
        return page.view(torch.uint8)

    def group_namespace(self, group: int) -> Any:
        return self.worker._work()._groups[group].namespace

    def stored_key(self, group: int, req_id: str, index: int) -> bytes:
        block_hash = self.requests[req_id].block_hashes[index]
        return bytes(engine_hashes(self.group_namespace(group), [block_hash])[0])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-hybrid"))


@pytest.fixture
def engines() -> Any:
    made: list[HybridEngine] = []

    def make(*args: Any, **kwargs: Any) -> HybridEngine:
        if made:
            made[-1].close()  # one worker connector per process at a time, as in vLLM
        engine = HybridEngine(*args, **kwargs)
        made.append(engine)
        return engine

    yield make
    if made:
        made[-1].close()


def _save_first_request(engine: HybridEngine) -> list[dict[int, torch.Tensor]]:
    """Run r1 (prefix + 4 tokens) to completion; each group's pages of the 6 prefix blocks."""
    engine.add("r1", PREFIX + [5, 6, 7, 8])
    engine.step()
    assert engine.seen["r1"].first_computed == 0  # nothing stored yet
    tables = engine.tables["r1"]
    saved = [{i: engine.group_page(g, tables[g][i]) for i in range(6)} for g in range(2)]
    engine.run()
    assert engine.seen["r1"].finish == FinishReason.LENGTH
    return saved


def test_connector_declares_hma_and_vllm_keeps_the_hybrid_manager(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = engines(tiny_model, daemon.url())
    assert isinstance(engine.worker, SupportsHMA)
    assert isinstance(engine.scheduler.connector, KVOffloadConnector)
    # vLLM's factory builds a connector on a hybrid model only if it supports HMA.
    assert KVConnectorFactory.supports_hma_config(engine.config.kv_transfer_config)
    # Each group stores under a namespace of its own: keys never collide across groups.
    full, sliding = engine.group_namespace(0), engine.group_namespace(1)
    assert full.fingerprint != sliding.fingerprint


def test_layer_parts_are_refused_for_hybrid_models(tiny_model: Path, engines: Any) -> None:
    with pytest.raises(ConfigError, match="not supported yet for hybrid models"):
        engines(tiny_model, "kv://127.0.0.1:9", layer_parts=2)


def test_a_fresh_engine_loads_every_group_bit_exact(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    first = engines(tiny_model, daemon.url())
    saved = _save_first_request(first)
    keys = {(g, i): first.stored_key(g, "r1", i) for g in range(2) for i in range(6)}
    with Client.connect(daemon.url()) as client:
        # Both groups saved all six blocks (the prompt ran in one step, so the sliding window
        # still held them), under different keys.
        assert all(client.exists(key[:16]) for key in keys.values())
    assert len({key for key in keys.values()}) == 12

    second = engines(tiny_model, daemon.url())  # a fresh scheduler, worker and KV memory
    second.add("r2", PREFIX + [9, 9, 9])
    out = second.step()
    assert "r2" not in out.num_scheduled_tokens  # parked while the worker loads
    second.run()
    seen = second.seen["r2"]
    assert seen.first_computed == len(PREFIX)
    assert seen.finish == FinishReason.LENGTH
    full, sliding = second.tables["r2"]
    for index in range(6):
        got = second.group_page(0, full[index])
        assert torch.equal(got, saved[0][index]), f"full-attention block {index}"
    # vLLM allocated the sliding-window group only the blocks inside its window.
    assert [i for i in range(6) if sliding[i] != 0] == list(WINDOW_BLOCKS)
    for index in WINDOW_BLOCKS:
        got = second.group_page(1, sliding[index])
        assert torch.equal(got, saved[1][index]), f"sliding-window block {index}"
        assert torch.equal(got, second.expected_group_page(1, seen.tokens, index))


def test_a_sliding_window_group_needs_only_its_window(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    first = engines(tiny_model, daemon.url())
    _save_first_request(first)
    with Client.connect(daemon.url()) as client:
        # Sliding-window blocks before the window are not needed for a 6-block hit...
        for index in range(WINDOW_BLOCKS[0]):
            assert client.delete(first.stored_key(1, "r1", index)[:16])
    second = engines(tiny_model, daemon.url())
    second.add("r2", PREFIX + [9])
    second.run()
    assert second.seen["r2"].first_computed == len(PREFIX)

    # ...but a full-attention block is: without block 3 the hit is blocks 0-2, for which the
    # sliding window needs blocks 1-2 (deleted), so nothing can be served from the store.
    with Client.connect(daemon.url()) as client:
        assert client.delete(first.stored_key(0, "r1", 3)[:16])
    third = engines(tiny_model, daemon.url())
    third.add("r3", PREFIX + [7])
    third.run()
    assert third.seen["r3"].first_computed == 0


def test_a_damaged_block_in_one_group_ends_the_hit_for_all_groups(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    first = engines(tiny_model, daemon.url())
    _save_first_request(first)
    # One bit of a sliding-window block inside the window, behind the SDK's back.
    damage_stored_block(daemon.url(), first.stored_key(1, "r1", WINDOW_BLOCKS[1]), -7)

    second = engines(tiny_model, daemon.url())
    second.add("r2", PREFIX + [9, 9])
    second.run()
    seen = second.seen["r2"]
    # The lookup saw every block; the load found the damage, dropped the block and reported
    # the request as failed (a hybrid model's failed load is per request). vLLM then asked
    # again: the sliding window now ends at block 5, so the full-attention group's intact
    # block 5 is not used either: both groups load blocks 0-4 and compute the rest.
    assert seen.first_computed == 5 * BLOCK
    assert seen.finish == FinishReason.LENGTH
    full, sliding = second.tables["r2"]
    for index in range(6):
        assert torch.equal(second.group_page(0, full[index]),
                           second.expected_group_page(0, seen.tokens, index))  # fmt: skip
        if sliding[index] != 0:
            assert torch.equal(second.group_page(1, sliding[index]),
                               second.expected_group_page(1, seen.tokens, index))  # fmt: skip

    # The damaged block was dropped and saved again by the recompute: a third engine loads
    # the whole prefix.
    third = engines(tiny_model, daemon.url())
    third.add("r3", PREFIX + [8])
    third.run()
    assert third.seen["r3"].first_computed == len(PREFIX)
    tokens = third.seen["r3"].tokens
    for index in WINDOW_BLOCKS:
        block = third.tables["r3"][1][index]
        assert torch.equal(third.group_page(1, block),
                           third.expected_group_page(1, tokens, index))  # fmt: skip


def test_sliding_window_blocks_freed_during_a_chunked_prefill_are_saved_intact(
    tiny_model: Path, start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    engine = engines(tiny_model, daemon.url(), chunk=2 * BLOCK)
    engine.add("r1", PREFIX + [5, 6, 7, 8])
    # Hold the worker's save thread, so that every save of the prefill runs after vLLM freed
    # the early sliding-window blocks and "other requests" overwrote every free block.
    gate = threading.Event()
    engine.worker._work()._saver.submit(gate.wait)
    noise = torch.Generator().manual_seed(3)
    freed = False
    for _ in range(20):  # 100 tokens at 32 a step: 4 prefill steps
        engine.step()
        if "r1" not in engine.scheduler.requests:
            break
        full, sliding = engine.scheduler.kv_cache_manager.get_block_ids("r1")
        freed |= sliding[0] == 0
        for block in set(range(1, NUM_BLOCKS)) - set(full) - set(sliding):
            for view in engine.kv.values():
                view[block].copy_(torch.randn(view[block].shape, generator=noise))
    gate.set()
    engine.run()
    # vLLM freed the first sliding-window blocks while the request still ran...
    assert freed
    tokens = engine.seen["r1"].tokens
    with Client.connect(daemon.url()) as client:
        # ...yet every block of both groups was saved with the KV the model computed (the
        # sliding blocks were copied before the next step could hand them to someone else).
        for group in range(2):
            for index in range(6):
                got = client.get(engine.stored_key(group, "r1", index))
                assert got is not None, f"group {group} block {index} was not saved"
                want = engine.expected_group_page(group, tokens, index).view(torch.float16)
                # Stored blocks are canonical: [layer][token][head][K and V].
                want = want.permute(0, 2, 1, 3).contiguous().view(torch.uint8).flatten()
                assert bytes(got) == bytes(want.numpy()), f"group {group} block {index}"
