"""KVOffloadConnector on a Mamba hybrid model inside vLLM's real scheduler and hybrid KV cache
manager (Mamba prefix caching in align mode).

The model has two KV cache groups, listed as vLLM lists a Qwen3-Next-style model's: the
linear-attention layers 0 and 2 first (a `MambaSpec` group: each layer keeps a conv state and
an SSM state per block boundary, pages padded to the attention page and overlaying it, as
vLLM lays them out), then full-attention layers 1 and 3. The "forward" is a real recurrence:
a request's state after a chunk is a hash of the state it starts from (read from the block
vLLM's align mode names for it) and the chunk's tokens, and the sampled token is derived from
the final state, so a wrong restored state changes the answer. Attention KV is a function of
the token prefix (`model_kv`). One engine saves a prompt; fresh engines load it: bytes
identical, answers identical to a reference run without the store, and each planted failure
(missing, damaged, wrong-layout state part) ends the hit at the right boundary.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM")

import blake3  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
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

from kvoffload.client_sdk import Client, Namespace, engine_hashes  # noqa: E402
from kvoffload.connectors.vllm import _compat  # noqa: E402
from kvoffload.connectors.vllm.state import check_state_codec  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MAMBA = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
FULL = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
GROUPS = [MAMBA, FULL]
LAYER_INDEX = {name: int(name.split(".")[2]) for name in MAMBA + FULL}
# Per layer: a conv state and an SSM state, as a gated delta-net layer keeps them.
SHAPES = ((4, 24), (2, 8, 8))
DTYPES = (torch.float16, torch.float32)
CHUNK = 2 * BLOCK  # tokens per step: the prefill stops at boundaries 32, 64 and 96
PREFIX = list(range(3000, 3096))  # 6 full blocks
PROMPT = PREFIX + [5, 6, 7, 8]
# Boundaries (in blocks) where vLLM cached a state while computing PROMPT in chunks of 32.
STATE_BOUNDARIES = (2, 4, 6)


def _state_bytes(dtypes: tuple[torch.dtype, ...] = DTYPES) -> int:
    return sum(math.prod(s) * torch.empty((), dtype=d).element_size()
               for s, d in zip(SHAPES, dtypes, strict=True))  # fmt: skip


def next_state(layer: int, state: bytes, tokens: list[int]) -> bytes:
    """The fake linear-attention layer's recurrence: the state after `tokens`, from `state`."""
    digest = blake3.blake3(state + np.asarray(tokens + [layer], dtype="<u4").tobytes()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return rng.integers(0, 256, size=len(state), dtype=np.uint8).tobytes()


class MambaEngine(Engine):
    """`Engine` with a Mamba group (align mode) before a full-attention group."""

    def __init__(
        self,
        model_dir: Path,
        url: str,
        dtypes: tuple[torch.dtype, ...] = DTYPES,
        connector: bool = True,
        **extra: Any,
    ) -> None:
        transfer = None
        if connector:
            transfer = KVTransferConfig(
                kv_connector="KVOffloadConnector",
                kv_connector_module_path="kvoffload.connectors.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={"url": url, "batch_blocks": 4, "claim": "all", **extra},
            )
        self.config, _, full = make_configs(model_dir, "LBNHC", transfer)  # type: ignore[arg-type]
        self.config.cache_config.mamba_cache_mode = "align"
        self.config.scheduler_config.max_num_batched_tokens = CHUNK
        self.config.scheduler_config.disable_hybrid_kv_cache_manager = False
        page = full.page_size_bytes
        mamba = MambaSpec(block_size=BLOCK, shapes=SHAPES, dtypes=dtypes,
                          page_size_padded=page, mamba_cache_mode="align")  # fmt: skip
        self.content = mamba.state_content_size_bytes
        assert self.content < page
        # One tensor per group over the same bytes: layer i of each group shares memory.
        tensors = [KVCacheTensor(size=page * NUM_BLOCKS * 2, layers=layers,
                                 layer_stride=page * NUM_BLOCKS, block_stride=page)
                   for layers in GROUPS]  # fmt: skip
        self.kv_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=tensors,
            kv_cache_groups=[KVCacheGroupSpec(MAMBA, mamba), KVCacheGroupSpec(FULL, full)],
        )
        self.scheduler = make_scheduler(self.config, self.kv_config)
        self.worker = None
        if connector:
            self.worker = KVConnectorFactory.create_connector(
                config=self.config, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_config
            )
            kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        self.raw = torch.zeros(tensors[0].size, dtype=torch.int8)
        self.kv: dict[str, torch.Tensor] = {}
        for spec, tensor in zip((mamba, full), tensors, strict=True):
            views = create_kv_cache_views(
                self.raw, spec, NUM_BLOCKS, KVCacheLayout["LBNHC"], tensor
            )
            self.kv.update(zip(tensor.layers, views, strict=True))
        if self.worker is not None:
            self.worker.register_kv_caches(self.kv)
        self.seen: dict[str, Seen] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.requests = {}
        self.sampled: dict[str, int] = {}
        # Called once a request's loaded blocks are in place, before its first forward
        # (negative controls plant a wrong state here, as a cache without verification would).
        self.on_first_forward: Any = None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None

    def execute(self, out: Any, defer_finalize: bool = False) -> None:
        if self.worker is None:
            # No connector: the same scheduler and forward, without the connector lifecycle.
            from vllm.v1.outputs import ModelRunnerOutput

            sampled = self._forward(out)
            ids = list(sampled)
            result = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[sampled[r] for r in ids], logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None,
            )  # fmt: skip
            for outputs in self.scheduler.update_from_output(out, result).values():
                for output in outputs.outputs:
                    if output.finish_reason is not None:
                        self.seen[output.request_id].finish = output.finish_reason
            return
        super().execute(out, defer_finalize)

    def state(self, layer: str, block: int) -> bytes:
        return bytes(self.kv[layer][block].flatten()[: self.content].view(torch.uint8).numpy())

    def set_state(self, layer: str, block: int, data: bytes) -> None:
        row = self.kv[layer][block].flatten()
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        row[: self.content].view(torch.uint8).copy_(src)

    def _forward(self, out: Any) -> dict[str, list[int]]:
        computed: dict[str, int] = {}
        first: list[str] = []
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            computed[new.req_id] = new.num_computed_tokens
            if self.seen[new.req_id].first_computed is None:
                self.seen[new.req_id].first_computed = new.num_computed_tokens
                first.append(new.req_id)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                for table, ids in zip(self.tables[req_id], new_ids, strict=True):
                    table.extend(ids)
            computed[req_id] = cached.num_computed_tokens[i]
        if self.on_first_forward is not None:
            for req_id in first:
                self.on_first_forward(self, req_id)
        sampled: dict[str, list[int]] = {}
        for req_id, count in out.num_scheduled_tokens.items():
            seen = self.seen[req_id]
            start = computed[req_id]
            stop = min(start + count, len(seen.tokens))
            mamba_table, full_table = self.tables[req_id]
            for pos in range(start, stop):
                block = full_table[pos // BLOCK]
                assert block != 0, f"{req_id}: computing position {pos} into the null block"
                for name in FULL:
                    kv = model_kv(LAYER_INDEX[name], seen.tokens[: pos + 1])
                    self.kv[name][block, :, pos % BLOCK, :] = kv
            # vLLM's align mode: the chunk starts from the state in the block of its first
            # token's predecessor and leaves its state in the block of its last token.
            dst = mamba_table[(stop - 1) // BLOCK]
            assert dst != 0, f"{req_id}: no state block for position {stop - 1}"
            for name in MAMBA:
                src = bytes(self.content) if start == 0 else \
                    self.state(name, mamba_table[(start - 1) // BLOCK])  # fmt: skip
                assert start == 0 or mamba_table[(start - 1) // BLOCK] != 0
                self.set_state(name, dst, next_state(LAYER_INDEX[name], src,
                                                     seen.tokens[start:stop]))  # fmt: skip
            if stop >= len(seen.tokens):
                token = 100 + self.state(MAMBA[0], dst)[0] % 50
                self.sampled[req_id] = token
                sampled[req_id] = [token]
            else:
                sampled[req_id] = []
        return sampled

    def stored_key(self, group: int, req_id: str, index: int) -> bytes:
        assert self.worker is not None
        namespace = self.worker._work()._groups[group].namespace
        block_hash = self.requests[req_id].block_hashes[index]
        return bytes(engine_hashes(namespace, [block_hash])[0])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-mamba"))


@pytest.fixture
def engines() -> Any:
    made: list[MambaEngine] = []

    def make(*args: Any, **kwargs: Any) -> MambaEngine:
        if made:
            made[-1].close()  # one worker connector per process at a time, as in vLLM
        engine = MambaEngine(*args, **kwargs)
        made.append(engine)
        return engine

    yield make
    if made:
        made[-1].close()


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, Any]:
    """The answer and final states without any store (shared by every test)."""
    engine = MambaEngine(tiny_model, "", connector=False)
    engine.add("ref", PROMPT)
    engine.run()
    assert engine.seen["ref"].finish == FinishReason.LENGTH
    table = engine.tables["ref"][0]
    states = {b: {name: engine.state(name, table[b - 1]) for name in MAMBA}
              for b in STATE_BOUNDARIES}  # fmt: skip
    return {"token": engine.sampled["ref"], "states": states}


def _save(engine: MambaEngine, req_id: str = "r1", prompt: list[int] = PROMPT) -> None:
    engine.add(req_id, prompt)
    engine.run()
    assert engine.seen[req_id].first_computed == 0
    assert engine.seen[req_id].finish == FinishReason.LENGTH


def _load(engines: Any, model: Path, url: str, req_id: str, **kwargs: Any) -> MambaEngine:
    engine = engines(model, url, **kwargs)
    engine.add(req_id, PROMPT)
    engine.run()
    assert engine.seen[req_id].finish == FinishReason.LENGTH
    return engine


def test_geometry_describes_every_group_by_kind(tiny_model: Path, engines: Any) -> None:
    engine = engines(tiny_model, "", connector=False)
    geometry = _compat.geometry(engine.config, engine.kv_config)
    state, full = geometry.groups
    assert (state.kind, full.kind) == ("state", "full")
    assert state.state_shapes == SHAPES
    assert state.state_dtypes == ("float16", "float32")
    assert state.head_width == _state_bytes()
    # The top-level fields are the attention group's, not the state group listed first.
    assert geometry.dtype == "float16" and geometry.num_kv_heads == HEADS
    assert geometry.layer_names == tuple(FULL)


def test_mamba_without_align_mode_is_refused_by_name(tiny_model: Path, engines: Any) -> None:
    engine = engines(tiny_model, "", connector=False)
    spec = engine.kv_config.kv_cache_groups[0].kv_cache_spec
    padded = spec.page_size_padded
    none = MambaSpec(block_size=BLOCK, shapes=SHAPES, dtypes=DTYPES, page_size_padded=padded)
    engine.kv_config.kv_cache_groups[0] = KVCacheGroupSpec(MAMBA, none)
    refused = r"KV cache group 0 \(MambaSpec.*--mamba-cache-mode align"
    with pytest.raises(ConfigError, match=refused):
        _compat.geometry(engine.config, engine.kv_config)


def test_chunked_local_attention_is_refused_by_name(tiny_model: Path, engines: Any) -> None:
    engine = engines(tiny_model, "", connector=False)
    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                                        dtype=torch.float16, attention_chunk_size=64)  # fmt: skip
    engine.kv_config.kv_cache_groups[1] = KVCacheGroupSpec(FULL, chunked)
    with pytest.raises(ConfigError, match=r"group 1 \(ChunkedLocalAttentionSpec.*"
                                          r"--disable-hybrid-kv-cache-manager"):  # fmt: skip
        _compat.geometry(engine.config, engine.kv_config)


def test_a_fresh_engine_loads_state_and_kv_bit_exact(
    tiny_model: Path, start_daemon: Any, engines: Any, reference: dict[str, Any]
) -> None:
    daemon = start_daemon()
    first = engines(tiny_model, daemon.url())
    _save(first)
    assert first.sampled["r1"] == reference["token"]
    with Client.connect(daemon.url()) as client:
        # A state part at every boundary vLLM cached, and nowhere else.
        for index in range(6):
            held = client.exists(first.stored_key(0, "r1", index)[:16])
            assert held == (index + 1 in STATE_BOUNDARIES), f"state of block {index}"
            assert client.exists(first.stored_key(1, "r1", index)[:16])

    seen_states: dict[str, bytes] = {}

    def grab(engine: MambaEngine, req_id: str) -> None:
        table = engine.tables[req_id][0]
        for name in MAMBA:
            seen_states[name] = engine.state(name, table[5])

    second = engines(tiny_model, daemon.url())
    second.on_first_forward = grab
    second.add("r2", PROMPT)
    out = second.step()
    assert "r2" not in out.num_scheduled_tokens  # parked while the worker loads
    second.run()
    seen = second.seen["r2"]
    assert seen.first_computed == len(PREFIX)  # 6 blocks from the store, 4 tokens computed
    # The loaded state is the saved one, byte for byte, and the answer the reference's.
    assert seen_states == reference["states"][6]
    assert second.sampled["r2"] == reference["token"]
    full = second.tables["r2"][1]
    for index in range(6):
        for name in FULL:
            page = second.kv[name][full[index]]
            for offset in range(BLOCK):
                pos = index * BLOCK + offset
                want = model_kv(LAYER_INDEX[name], PROMPT[: pos + 1])
                got = page[:, offset, :].view(torch.int16)  # bytes: random KV holds NaNs
                assert torch.equal(got, want.view(torch.int16)), f"{name} block {index}"


def test_a_missing_state_part_ends_the_hit_at_the_boundary_before(
    tiny_model: Path, start_daemon: Any, engines: Any, reference: dict[str, Any]
) -> None:
    daemon = start_daemon()
    first = engines(tiny_model, daemon.url())
    _save(first)
    with Client.connect(daemon.url()) as client:
        assert client.delete(first.stored_key(0, "r1", 5)[:16])  # the state at 96 tokens
    second = _load(engines, tiny_model, daemon.url(), "r2")
    # Every KV block is there, but the last state is at 64 tokens: the hit ends there.
    assert second.seen["r2"].first_computed == 4 * BLOCK
    assert second.sampled["r2"] == reference["token"]


def test_a_damaged_state_part_ends_the_hit_and_the_answer_is_recomputed(
    tiny_model: Path, start_daemon: Any, engines: Any, reference: dict[str, Any]
) -> None:
    daemon = start_daemon()
    first = engines(tiny_model, daemon.url())
    _save(first)
    damage_stored_block(daemon.url(), first.stored_key(0, "r1", 5), -5)
    second = _load(engines, tiny_model, daemon.url(), "r2")
    seen = second.seen["r2"]
    # The lookup saw the damaged part; the load found it, dropped it and failed the request;
    # vLLM asked again and the hit now ends at the state before (64 tokens).
    assert seen.first_computed == 4 * BLOCK
    assert second.sampled["r2"] == reference["token"]
    table = second.tables["r2"][0]
    assert {n: second.state(n, table[5]) for n in MAMBA} == reference["states"][6]


def test_a_damaged_kv_part_ends_the_hit_at_the_state_before_it(
    tiny_model: Path, start_daemon: Any, engines: Any, reference: dict[str, Any]
) -> None:
    daemon = start_daemon()
    first = engines(tiny_model, daemon.url())
    _save(first)
    # Attention block 4 (tokens 64-79) damaged: a hit needs every KV block before its
    # boundary, so the longest usable boundary with a state is 64 tokens (block 3).
    damage_stored_block(daemon.url(), first.stored_key(1, "r1", 4), -3)
    second = _load(engines, tiny_model, daemon.url(), "r2")
    assert second.seen["r2"].first_computed == 4 * BLOCK
    assert second.sampled["r2"] == reference["token"]


def test_a_state_of_another_layout_never_answers(
    tiny_model: Path, start_daemon: Any, engines: Any, reference: dict[str, Any]
) -> None:
    daemon = start_daemon()
    first = engines(tiny_model, daemon.url())
    _save(first)
    # The same model with an SSM state in bfloat16: another key for every state part, so no
    # state is found and nothing is claimed (the attention KV alone is not a hit).
    other = (torch.float16, torch.bfloat16)
    second = _load(engines, tiny_model, daemon.url(), "r2", dtypes=other)
    assert second.seen["r2"].first_computed == 0
    # Its own answer: computed, not restored from the float32 states.
    assert "r2" in second.sampled


def test_restoring_zeroed_or_another_prefixs_state_changes_the_answer(
    tiny_model: Path, start_daemon: Any, engines: Any, reference: dict[str, Any]
) -> None:
    """Negative controls: the checks above would catch a wrong state, because one changes the
    answer (a cache that restored the KV but not the state, or the wrong state)."""
    daemon = start_daemon()
    first = engines(tiny_model, daemon.url())
    _save(first)
    other = list(range(4000, 4096)) + [5, 6, 7, 8]
    _save(first, "r9", other)
    wrong_table = first.tables["r9"][0]
    wrong = {name: first.state(name, wrong_table[5]) for name in MAMBA}

    def zero(engine: MambaEngine, req_id: str) -> None:
        for name in MAMBA:
            engine.set_state(name, engine.tables[req_id][0][5], bytes(engine.content))

    def swap(engine: MambaEngine, req_id: str) -> None:
        for name in MAMBA:
            engine.set_state(name, engine.tables[req_id][0][5], wrong[name])

    answers = {}
    for plant in (zero, swap):
        engine = engines(tiny_model, daemon.url())
        engine.on_first_forward = plant
        engine.add("r2", PROMPT)
        engine.run()
        assert engine.seen["r2"].first_computed == len(PREFIX)
        answers[plant.__name__] = engine.sampled["r2"]
        final = engine.tables["r2"][0][6]
        assert engine.state(MAMBA[0], final) != next_state(
            0, reference["states"][6][MAMBA[0]], PROMPT[96:]
        )
    assert reference["token"] not in answers.values()


def test_a_lossy_codec_is_refused_for_state_groups() -> None:
    lossy = Namespace(model="m", dtype="float16", codec="fp8")
    refused = pytest.raises(ConfigError, match=r"group 0 .*compound.*'fp8' is lossy")
    with Client.connect("local://", namespace=lossy) as client, refused:
        check_state_codec(client, "KV cache group 0")
    with Client.connect("local://", codec="zstd") as client:
        check_state_codec(client, "KV cache group 0")  # lossless: accepted
