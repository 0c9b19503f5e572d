"""KVOffloadTier as the secondary tier of vLLM's own CPU offloading (0.33.0 and 0.32.0),
against a live `kvoffload serve`.

vLLM's `TieringOffloadingSpec` builds the tier from its ``secondary_tiers`` config (type +
module_path) exactly as in a server; the test then drives vLLM's real
`TieringOffloadingManager`: chunks stored in the CPU primary tier cascade to the store, are
evicted from the primary tier, and come back through a promotion with the same bytes. The
GPU-to-CPU copies are the only part played by the test (it writes the primary tier's shared
memory as vLLM's worker would).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM")

from vllm.config import KVEventsConfig, KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402
    build_offloading_config,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm_harness import make_configs, make_scheduler, write_tiny_model  # noqa: E402

from kvoffload.client_sdk import Client, engine_hashes  # noqa: E402
from kvoffload.connectors.vllm import KVOffloadTier  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PRIMARY_CHUNKS = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _transfer(url: str, chunk_bytes: int, **tier: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": PRIMARY_CHUNKS * chunk_bytes,
            "eviction_policy": "lru",
            "secondary_tiers": [
                {
                    "type": "KVOffloadTier",
                    "module_path": "kvoffload.connectors.vllm",
                    "url": url,
                    **tier,
                }
            ],
        },
    )


def _chunk_bytes(tiny_model: Path) -> int:
    _, _, spec = make_configs(tiny_model, "LBNHC", _transfer("kv://127.0.0.1:9", 4096))
    return int(spec.page_size_bytes) * 2  # two layers per chunk


@pytest.fixture
def manager(tiny_model: Path, start_daemon: Any) -> Iterator[tuple[Any, Any]]:
    daemon = start_daemon()
    config, kv_config, _ = make_configs(
        tiny_model, "LBNHC", _transfer(daemon.url(retries="1"), _chunk_bytes(tiny_model))
    )
    spec = TieringOffloadingSpec(build_offloading_config(config, kv_config))
    manager = spec.get_manager()
    yield manager, daemon
    manager.shutdown()


def _locked(manager: Any) -> Any:
    """The manager's lock (vLLM 0.33); vLLM 0.32's manager has none and is single-threaded."""
    return getattr(manager, "lock", None) or contextlib.nullcontext()


def _keys(name: str, n: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{name}{i}".encode()).digest(), 0) for i in range(n)]


def _settle(manager: Any) -> None:
    """End scheduler steps until no tier transfer is in flight."""
    for _ in range(3000):
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        if not manager.has_pending_work():
            return
        time.sleep(0.01)
    raise AssertionError("tier transfers did not finish")


def _store(manager: Any, req: str, keys: list[bytes], fill: int) -> list[bytes]:
    """Offload `keys` into the primary tier as vLLM's worker would; returns their bytes."""
    ctx = ReqContext(req_id=req)
    manager.on_new_request(ctx)
    view = manager.primary_tier.get_kv_memoryview()
    with _locked(manager):
        out = manager.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == keys
    size = view.strides[0]
    written = []
    with view.cast("B") as flat:
        for i, chunk in enumerate(out.store_spec.chunk_ids):
            data = hashlib.shake_256(f"{fill}:{i}".encode()).digest(size)
            flat[int(chunk) * size : (int(chunk) + 1) * size] = data
            written.append(data)
    with _locked(manager):
        manager.complete_store(keys, ctx)  # cascades to the secondary tier
        manager.on_request_finished(ctx)
    _settle(manager)
    return written


def _promote(manager: Any, req: str, key: bytes) -> list[Any]:
    """Look `key` up the way the scheduler does, step after step, until it settles; every
    answer on the way."""
    ctx = ReqContext(req_id=req)
    manager.on_new_request(ctx)
    answers = []
    for _ in range(3000):
        with _locked(manager):
            answers.append(manager.lookup(key, ctx))
        if answers[-1] in (LookupResult.HIT, LookupResult.MISS):
            manager.on_request_finished(ctx)
            return answers
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(req,), preempted_req_ids=()))
        time.sleep(0.01)
    raise AssertionError("lookup never settled")


def test_vllm_builds_the_tier_from_its_module_path(tiny_model: Path, start_daemon: Any) -> None:
    daemon = start_daemon()
    config, kv_config, _ = make_configs(
        tiny_model,
        "LBNHC",
        _transfer(daemon.url(), _chunk_bytes(tiny_model)),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    scheduler = make_scheduler(config, kv_config)
    tiers = scheduler.connector.connector_scheduler.manager.secondary_tiers
    assert [type(t) for t in tiers] == [KVOffloadTier]
    scheduler.shutdown()


def test_chunks_cascade_to_the_store_and_come_back_exact(manager: tuple[Any, Any]) -> None:
    mgr, daemon = manager
    tier = mgr.secondary_tiers[0]
    first = _keys("a", 2)
    written = _store(mgr, "a", first, fill=1)
    with Client.connect(daemon.url(), namespace=tier.namespace) as client:
        assert [client.get(h) for h in engine_hashes(tier.namespace, first)] == written
    # Fill the primary tier with other chunks: the first ones are evicted from it (LRU).
    for i in range(PRIMARY_CHUNKS):
        _store(mgr, f"b{i}", _keys(f"b{i}", 1), fill=10 + i)
    # Back through a promotion from the store into the primary tier, byte for byte.
    view = mgr.primary_tier.get_kv_memoryview()
    size = view.strides[0]
    for key, data in zip(first, written, strict=True):
        answers = _promote(mgr, f"load-{key[:4].hex()}", key)
        # Not in the primary tier any more: asked the store (RETRY), promoted (HIT_PENDING).
        assert answers[0] == LookupResult.RETRY and LookupResult.HIT_PENDING in answers
        assert answers[-1] == LookupResult.HIT
        ctx = ReqContext(req_id="reader")
        with _locked(mgr):
            spec = mgr.prepare_load([key], ctx)
        chunk = int(spec.chunk_ids[0])
        with view.cast("B") as flat:
            assert bytes(flat[chunk * size : (chunk + 1) * size]) == data
        with _locked(mgr):
            mgr.complete_load([key], ctx)


def test_a_failed_promotion_is_a_miss_never_wrong_bytes(manager: tuple[Any, Any]) -> None:
    mgr, daemon = manager
    tier = mgr.secondary_tiers[0]
    first, second = _keys("c", 1), _keys("e", 1)
    _store(mgr, "c", first, fill=3)
    _store(mgr, "e", second, fill=4)
    for i in range(PRIMARY_CHUNKS):
        _store(mgr, f"d{i}", _keys(f"d{i}", 1), fill=20 + i)
    # Damage the stored copy of the first chunk behind the SDK's back.
    damage_stored_block(daemon.url(), engine_hashes(tier.namespace, first)[0])
    answers = _promote(mgr, "load-c", first[0])
    # The store said it has it, the promotion failed verification: a miss, recomputed.
    assert LookupResult.HIT_PENDING in answers and answers[-1] == LookupResult.MISS
    # A store that is down: lookups answer miss.
    daemon.stop()
    assert _promote(mgr, "load-e", second[0])[-1] == LookupResult.MISS


def test_a_lossy_codec_is_refused_with_the_reason(tiny_model: Path) -> None:
    # vLLM's offload config gives a tier no KV shape, which the lossy KV codecs quantise by;
    # without this check, every store job would fail at its first put instead.
    transfer = _transfer("kv://127.0.0.1:9", _chunk_bytes(tiny_model), codec="fp8")
    config, kv_config, _ = make_configs(tiny_model, "LBNHC", transfer)
    spec = TieringOffloadingSpec(build_offloading_config(config, kv_config))
    # (vLLM 0.32 names no group kinds, so there the group may be state: refused as such.)
    refused = r"codec 'fp8' is lossy(, and a lossy KV codec needs| and KV cache group 0)"
    with pytest.raises(ConfigError, match=refused):
        spec.get_manager()
