"""KVOffloadTier under vLLM 0.33's own offloading with a Mamba hybrid model: vLLM's real
`OffloadingConnector` scheduler, `TieringOffloadingSpec` and tiering manager, against a live
`kvoffload serve`.

The model's KV cache config is the one `test_vllm_hybrid.py` uses: a Mamba group (align mode,
linear-attention layers 0 and 2, conv and SSM states padded to the attention page) listed
first, then full-attention layers 1 and 3. vLLM hands its offloading one chunk per block and
group, keyed by block hash and group index; for the Mamba group a chunk holds the state at that
block's boundary, and align mode leaves states only at some boundaries (here after blocks 2, 4
and 6, as a prefill in 32-token steps does). Engine A puts a prompt's chunks through its CPU
tier into the store (the worker's GPU-to-CPU copies, which need CUDA, are played by writing
the primary tier's memory); a fresh engine B's scheduler asks its connector for the same
prompt, and the test reads the hit vLLM claims and the bytes it promoted. Each planted failure
(a missing or damaged state part, a damaged attention part) ends the hit at the last boundary
where every group still has its parts.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import OffloadingGroupConfig  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm_harness import (  # noqa: E402
    BLOCK,
    NUM_BLOCKS,
    make_configs,
    make_scheduler,
    write_tiny_model,
)

from kvoffload.client_sdk import Client, engine_hashes  # noqa: E402
from kvoffload.connectors.vllm import KVOffloadTier, _compat  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MAMBA = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
FULL = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
STATE, ATTN = 0, 1  # group indices, in vLLM's order
SHAPES = ((4, 24), (2, 8, 8))
DTYPES = (torch.float16, torch.float32)
PROMPT = list(range(3000, 3096)) + [5, 6, 7, 8]  # 6 full blocks and a tail
BLOCKS = 6
STATE_CHUNKS = (1, 3, 5)  # chunks whose boundary (blocks 2, 4, 6) has a cached state
PRIMARY_CHUNKS = 64
TAIL_HASH = 4  # tokens per block hash in the partial-tail test (vLLM's prefix_match_unit)
# vLLM 0.33 tells a tier each group's window in chunks (a Mamba group's is 1); 0.32 does not.
KINDS = (
    ("window=1", "full")
    if "sliding_window_size_in_chunks" in OffloadingGroupConfig.__dataclass_fields__
    else ("unknown", "unknown")
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-tier-mamba"))


def _configs(
    model: Path,
    url: str,
    primary_bytes: int,
    state_dtypes: Any = DTYPES,
    hash_tokens: int = BLOCK,
    **tier: Any,
) -> tuple[Any, Any]:
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": primary_bytes,
            "eviction_policy": "lru",
            "secondary_tiers": [
                {"type": "KVOffloadTier", "module_path": "kvoffload.connectors.vllm",
                 "url": url, **tier}
            ],
        },
    )  # fmt: skip
    config, _, full = make_configs(model, "LBNHC", transfer)
    config.cache_config.mamba_cache_mode = "align"
    if hash_tokens != BLOCK:  # block hashes finer than blocks: vLLM's partial tails
        config.cache_config.prefix_match_unit = hash_tokens
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    page = full.page_size_bytes
    mamba = MambaSpec(block_size=BLOCK, shapes=SHAPES, dtypes=state_dtypes,
                      page_size_padded=page, mamba_cache_mode="align")  # fmt: skip
    # One tensor per group over the same bytes: layer i of each group shares memory.
    tensors = [KVCacheTensor(size=page * NUM_BLOCKS * 2, layers=layers,
                             layer_stride=page * NUM_BLOCKS, block_stride=page)
               for layers in (MAMBA, FULL)]  # fmt: skip
    kv_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(MAMBA, mamba), KVCacheGroupSpec(FULL, full)],
    )
    return config, kv_config


def _hybrid(
    model: Path, url: str, state_dtypes: Any = DTYPES, hash_tokens: int = BLOCK, **tier: Any
) -> tuple[Any, Any]:
    """vLLM's config of the hybrid model with the tier, its primary tier sized to hold
    PRIMARY_CHUNKS chunks; `state_dtypes`: the Mamba states' dtypes (conv, SSM);
    `hash_tokens`: tokens per block hash."""
    config, kv_config = _configs(model, url, 1 << 30, state_dtypes, hash_tokens, **tier)
    chunk = TieringOffloadingSpec(build_offloading_config(config, kv_config)).kv_bytes_per_chunk
    return _configs(model, url, PRIMARY_CHUNKS * chunk, state_dtypes, hash_tokens, **tier)


def _block_hashes(prompt: list[int], hash_tokens: int = BLOCK) -> list[bytes]:
    init_none_hash(sha256)
    return list(_request("hashes", prompt, hash_tokens).block_hashes)


def _request(req_id: str, prompt: list[int], hash_tokens: int = BLOCK) -> Request:
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=req_id, prompt_token_ids=prompt, sampling_params=params,
        pooling_params=None, mm_features=None,
        block_hasher=get_request_block_hasher(hash_tokens, sha256),
    )  # fmt: skip


def _keys() -> dict[tuple[int, int], bytes]:
    """The offload keys engine A stores: every attention chunk, and a state chunk where align
    mode cached a state; by (group, chunk)."""
    hashes = _block_hashes(PROMPT)
    keys = {(ATTN, i): make_offload_key(hashes[i], ATTN) for i in range(BLOCKS)}
    keys.update({(STATE, i): make_offload_key(hashes[i], STATE) for i in STATE_CHUNKS})
    return keys


def _locked(manager: Any) -> Any:
    return getattr(manager, "lock", None) or contextlib.nullcontext()


def _settle(manager: Any) -> None:
    for _ in range(3000):
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        if not manager.has_pending_work():
            return
        time.sleep(0.01)
    raise AssertionError("tier transfers did not finish")


def _save(
    model: Path,
    url: str,
    inspect: Any = None,
    keys: list[bytes] | None = None,
    hash_tokens: int = BLOCK,
    **tier: Any,
) -> dict[bytes, bytes]:
    """Engine A: offload the prompt's chunks of both groups (or `keys`) into its CPU tier, as
    vLLM's worker would, and let them cascade to the store; returns each key's bytes.
    `inspect` is called with the manager before it shuts down."""
    config, kv_config = _hybrid(model, url, hash_tokens=hash_tokens, **tier)
    spec = TieringOffloadingSpec(build_offloading_config(config, kv_config))
    # Built by vLLM's connector scheduler, as in a server: the tier reads the KV cache config
    # from it (each state group's layout).
    manager = OffloadingConnectorScheduler(spec, config, kv_config).manager
    try:
        keys = keys or list(_keys().values())
        ctx = ReqContext(req_id="save")
        manager.on_new_request(ctx)
        with _locked(manager):
            out = manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        view = manager.primary_tier.get_kv_memoryview()
        size = view.strides[0]
        written = {}
        with view.cast("B") as flat:
            for key, chunk in zip(keys, out.store_spec.chunk_ids, strict=True):
                data = hashlib.shake_256(key).digest(size)
                flat[int(chunk) * size : (int(chunk) + 1) * size] = data
                written[key] = data
        with _locked(manager):
            manager.complete_store(keys, ctx)
            manager.on_request_finished(ctx)
        _settle(manager)
        if inspect is not None:
            inspect(manager)
        return written
    finally:
        manager.shutdown()


@pytest.fixture
def fresh(tiny_model: Path) -> Iterator[Any]:
    """Make engine B: a real scheduler with vLLM's OffloadingConnector and an empty CPU tier."""
    made: list[Any] = []

    def make(url: str, state_dtypes: Any = DTYPES, hash_tokens: int = BLOCK, **tier: Any) -> Any:
        config, kv_config = _hybrid(tiny_model, url, state_dtypes, hash_tokens, **tier)
        scheduler = make_scheduler(config, kv_config, hash_tokens)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.shutdown()


def _tier(scheduler: Any) -> KVOffloadTier:
    tiers = scheduler.connector.connector_scheduler.manager.secondary_tiers
    assert [type(t) for t in tiers] == [KVOffloadTier]
    return tiers[0]  # type: ignore[no-any-return]


def _claimed(scheduler: Any, req_id: str = "b", hash_tokens: int = BLOCK) -> int:
    """Schedule the prompt step after step until vLLM decides: the tokens it loads from the
    offload tiers (0 when it computes from the start)."""
    request = _request(req_id, PROMPT, hash_tokens)
    scheduler.add_request(request)
    for _ in range(3000):
        out = scheduler.schedule()
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return int(request.num_computed_tokens)
        for new in out.scheduled_new_reqs:
            if new.req_id == req_id:  # computed here, from the tokens it had before
                return int(new.num_computed_tokens)
        time.sleep(0.01)
    raise AssertionError("vLLM never scheduled the request")


def _primary_bytes(scheduler: Any, key: bytes) -> bytes:
    """A promoted chunk's bytes in engine B's CPU tier."""
    manager = scheduler.connector.connector_scheduler.manager
    view = manager.primary_tier.get_kv_memoryview()
    size = view.strides[0]
    ctx = ReqContext(req_id=f"read-{key[:4].hex()}")
    with _locked(manager):
        spec = manager.prepare_load([key], ctx)
    chunk = int(spec.chunk_ids[0])
    with view.cast("B") as flat:
        data = bytes(flat[chunk * size : (chunk + 1) * size])
    with _locked(manager):
        manager.complete_load([key], ctx)
    return data


@pytest.mark.parametrize("codec", ["", "zstd"])
def test_every_group_is_stored_and_a_fresh_engine_hits_all_of_them(
    tiny_model: Path, start_daemon: Any, fresh: Any, codec: str
) -> None:
    daemon = start_daemon()
    written = _save(tiny_model, daemon.url(), codec=codec)
    scheduler = fresh(daemon.url(), codec=codec)
    tier = _tier(scheduler)
    assert [g.group_id for g in tier.groups] == [STATE, ATTN]
    assert tuple(g.kind for g in tier.groups) == KINDS
    # Each group's parts under a namespace of its own.
    assert tier.namespaces[STATE] != tier.namespaces[ATTN]
    with Client.connect(daemon.url(), namespace=tier.namespace) as client:
        assert [client.get(h) for h in tier.hashes(list(written))] == list(written.values())
        # Not under the model's single-group keys.
        assert [client.get(h) for h in engine_hashes(tier.namespace, list(written))] == [
            None
        ] * len(written)
    # All 6 blocks: every attention chunk and the state at block 6.
    assert _claimed(scheduler) == BLOCKS * BLOCK
    keys = _keys()
    for group, chunk in [(STATE, 5), *((ATTN, i) for i in range(BLOCKS))]:
        key = keys[group, chunk]
        assert _primary_bytes(scheduler, key) == written[key]


def _plant(url: str, scheduler: Any, fault: str, group: int, chunk: int) -> None:
    key = _tier(scheduler).hashes([_keys()[group, chunk]])[0]
    if fault == "missing":
        with Client.connect(url) as client:
            assert client.delete(key)
    else:
        damage_stored_block(url, key)


@pytest.mark.parametrize(
    ("fault", "group", "chunk", "hit_blocks"),
    [
        # The state at block 6 missing or damaged: the hit ends at the state before it.
        ("missing", STATE, 5, 4),
        ("damaged", STATE, 5, 4),
        ("missing", STATE, 3, 6),  # a state behind the last one is not needed
        # An attention part damaged at block 5 (chunk 4): the attention prefix ends at block
        # 4, where a state is; missing at block 3 (chunk 2): the state before is at block 2.
        ("damaged", ATTN, 4, 4),
        ("missing", ATTN, 2, 2),
    ],
)
def test_a_missing_or_damaged_part_ends_the_hit_where_every_group_has_its_parts(
    tiny_model: Path,
    start_daemon: Any,
    fresh: Any,
    fault: str,
    group: int,
    chunk: int,
    hit_blocks: int,
) -> None:
    daemon = start_daemon()
    _save(tiny_model, daemon.url())
    scheduler = fresh(daemon.url())
    _plant(daemon.url(), scheduler, fault, group, chunk)
    assert _claimed(scheduler) == hit_blocks * BLOCK


def test_a_part_chains_to_the_one_before_it_in_its_own_group(tiny_model: Path) -> None:
    keys = _keys()
    parents: dict[tuple[int, int], bytes | None] = {}

    def inspect(manager: Any) -> None:
        tier = manager.secondary_tiers[0]
        engine = tier.client.transport.engine  # the tier's own embedded store (local://)
        for where, key in keys.items():
            found, parent, _ = engine.describe(tier.hashes([key])[0][:16])
            assert found
            parents[where] = parent
        # What the parents should be: the attention chain (where vLLM says it is one: 0.33),
        # and no parent for a state part.
        chain = tier.hashes([keys[ATTN, i] for i in range(BLOCKS)])
        chained = KINDS[1] == "full"
        expected = {(ATTN, i): chain[i - 1][:16] if i and chained else None
                    for i in range(BLOCKS)}  # fmt: skip
        expected.update({(STATE, i): None for i in STATE_CHUNKS})
        assert parents == expected

    _save(tiny_model, "local://", inspect=inspect)
    assert len(parents) == len(keys)


def test_no_state_part_means_no_hit(tiny_model: Path, start_daemon: Any, fresh: Any) -> None:
    daemon = start_daemon()
    _save(tiny_model, daemon.url())
    scheduler = fresh(daemon.url())
    for chunk in STATE_CHUNKS:
        _plant(daemon.url(), scheduler, "missing", STATE, chunk)
    # Every attention part is there, but no boundary has a state: vLLM recomputes.
    assert _claimed(scheduler) == 0


def test_a_lossy_codec_is_refused_naming_the_state_group(tiny_model: Path) -> None:
    refused = rf"codec 'fp8' is lossy and KV cache group 0 \({KINDS[0]}; layers model\.layers\.0"
    with pytest.raises(ConfigError, match=refused):
        config, kv_config = _hybrid(tiny_model, "kv://127.0.0.1:9", codec="fp8")
        TieringOffloadingSpec(build_offloading_config(config, kv_config)).get_manager()


def test_a_chunk_of_an_unknown_group_fails_its_job_by_name(
    tiny_model: Path, start_daemon: Any, fresh: Any, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = start_daemon()
    scheduler = fresh(daemon.url())
    tier = _tier(scheduler)
    key = make_offload_key(_block_hashes(PROMPT)[0], 7)
    job = TransferJob(job_id=1, keys=[key], chunk_ids=np.array([0]), is_promotion=False,
                      req_context=ReqContext(req_id="x"))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvoffload.connectors.vllm.tier"):
        tier.submit_store(job)
        tier.drain_jobs()
    results = list(tier.get_finished_jobs())
    assert [(r.job_id, r.success) for r in results] == [(1, False)]
    assert "KV cache group 7, which its offload config does not list (groups [0, 1])" in (
        caplog.text
    )


def _hot(url: str) -> tuple[int, int]:
    """The daemon's Lookup and Exists requests so far (all answered by its C hot path)."""
    with Client.connect(url) as client:
        server = client.stats().store["server"]
    assert isinstance(server, dict)
    return int(server["hot_lookups"]), int(server["hot_exists"])


def test_a_lookup_asks_the_store_once_per_group(
    tiny_model: Path, start_daemon: Any, fresh: Any
) -> None:
    """vLLM asks every chunk of both groups of the prompt (the attention chain in order, every
    state chunk from the end back): one step's batch reaches the store as one Lookup for the
    attention group and one pipelined run of Exists requests for the state group (one
    exists_many call), not a Lookup per state chunk; the answers are each part's own. Under
    vLLM 0.32, which names no group kinds, both groups are asked part by part, still in one
    call per group."""
    daemon = start_daemon()
    _save(tiny_model, daemon.url())
    tier = _tier(fresh(daemon.url()))
    hashes = _block_hashes(PROMPT)
    asked = [make_offload_key(hashes[i], ATTN) for i in range(BLOCKS)]
    asked += [make_offload_key(hashes[i], STATE) for i in reversed(range(BLOCKS))]
    ctx = ReqContext(req_id="count")
    tier.on_new_request(ctx)
    before = _hot(daemon.url())
    assert {tier.lookup(key, ctx) for key in asked} == {_compat.LookupResult.RETRY}
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    for _ in range(3000):  # the batch goes to vLLM's lookup thread; its answers come back
        tier.on_schedule_end(end)
        answers = [tier.lookup(key, ctx) for key in asked]
        if _compat.LookupResult.RETRY not in answers:
            break
        time.sleep(0.01)
    hit, miss = _compat.LookupResult.HIT, _compat.LookupResult.MISS
    states = [hit if i in STATE_CHUNKS else miss for i in reversed(range(BLOCKS))]
    assert answers == [hit] * BLOCKS + states
    lookups, exists = (a - b for a, b in zip(_hot(daemon.url()), before, strict=True))
    # vLLM 0.32 names no group kinds, so both groups are sparse there: one exists_many each.
    chained = KINDS[1] == "full"
    assert (lookups, exists) == ((1, BLOCKS) if chained else (0, 2 * BLOCKS))


def test_engines_whose_state_dtypes_differ_share_no_state_part(
    tiny_model: Path, start_daemon: Any, fresh: Any
) -> None:
    """The state dtypes (vLLM's --mamba-cache-dtype / --mamba-ssm-cache-dtype) change a state
    page's bytes but not its padded size: the tier reads them from vLLM's KV cache config into
    the state group's namespace, so an engine with other state dtypes misses every state part
    (and claims nothing), while the attention parts keep their keys and the same dtypes hit."""
    daemon = start_daemon()
    _save(tiny_model, daemon.url())  # states float16 (conv) and float32 (SSM)
    same = fresh(daemon.url())
    other = fresh(daemon.url(), state_dtypes=(torch.float16, torch.float16))
    assert _claimed(other) == 0
    assert _claimed(same) == BLOCKS * BLOCK
    mine, theirs = _tier(same), _tier(other)
    assert theirs.namespaces[ATTN] == mine.namespaces[ATTN]
    assert theirs.namespaces[STATE] != mine.namespaces[STATE]
    assert "dtypes=float16,float32" in mine.groups[STATE].state
    assert "dtypes=float16,float16" in theirs.groups[STATE].state
    assert mine.groups[ATTN].state == theirs.groups[ATTN].state == ""


@pytest.mark.parametrize(
    ("stored", "hit_tokens"),
    [((STATE, ATTN), 2 * TAIL_HASH), ((STATE,), 0)],  # a state alone is no hit
    ids=["both-groups", "state-only"],
)
def test_a_partial_tail_answers_for_itself(
    tiny_model: Path, start_daemon: Any, fresh: Any, stored: tuple[int, ...], hit_tokens: int
) -> None:
    """With block hashes finer than blocks (4 tokens, blocks of 16), vLLM may load a hit that
    ends inside a block (a partial tail: the attention block and the state at that hash
    boundary, `supports_partial_tail`). It asks a full group's partial tails after its chain,
    the largest boundary first; the tier answers each alone (it reads their positions from
    vLLM's request context), so with the tails at 8 tokens stored and the ones at 12 not,
    vLLM loads 8 tokens, where a prefix count over the full group's keys lost that hit."""
    daemon = start_daemon()
    hashes = _block_hashes(PROMPT, TAIL_HASH)
    # The parts at the boundary of 8 tokens (the second hash), nothing else.
    _save(tiny_model, daemon.url(), keys=[make_offload_key(hashes[1], g) for g in stored],
          hash_tokens=TAIL_HASH)  # fmt: skip
    scheduler = fresh(daemon.url(), hash_tokens=TAIL_HASH)
    assert scheduler.connector.connector_scheduler.config.supports_partial_tail
    assert _claimed(scheduler, hash_tokens=TAIL_HASH) == hit_tokens
