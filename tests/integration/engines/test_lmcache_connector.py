"""KVOffloadRemoteConnector inside LMCache 0.5.6's own engine, against a live `kvoffload serve`.

LMCache's `LMCacheEngine` (CPU memory allocator, chunked token database, storage manager) loads
the connector through ``remote_storage_plugins`` and stores and retrieves chunks through it;
its local CPU cache is off, so every hit travels through the daemon. The serving engine side is
played by `CpuKV`, a `GPUConnectorInterface` that copies between LMCache's chunk buffers and a
CPU tensor (LMCache's real GPU connectors need CUDA kernels).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("lmcache", "KVOFFLOAD_REQUIRE_LMCACHE")

import torch  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from kvoffload.client_sdk import engine_hashes  # noqa: E402
from kvoffload.connectors.lmcache import KVOffloadRemoteConnector  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LAYERS = 2
HEADS = 2
DIM = 16
CHUNK = 16
BACKEND = "RemoteBackend-kvoffload"


class CpuKV(GPUConnectorInterface):
    """The serving engine's KV for one sequence, ``kv=[2, layers, tokens, heads*dim]``."""

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor[:, :, : end - start].copy_(kwargs["kv"][:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kv"][:, :, start:end].copy_(memory_obj.tensor[:, :, : end - start])

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                       **kwargs: Any) -> None:  # fmt: skip
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HEADS * DIM])


def _config(url: str, **more: Any) -> Any:
    extra = {
        "remote_storage_plugin.kvoffload.module_path": "kvoffload.connectors.lmcache",
        "remote_storage_plugin.kvoffload.class_name": "KVOffloadRemoteConnector",
        "remote_storage_plugin.kvoffload.url": url,
        **more.pop("extra", {}),
    }
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=False,  # no hot cache: every hit comes through the store
        max_local_cpu_size=0.05,
        remote_serde="naive",
        remote_storage_plugins=["kvoffload"],
        extra_config=extra,
        **more,
    )


def _metadata() -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="org/tiny-model", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM),
        chunk_size=CHUNK,
    )  # fmt: skip


@pytest.fixture
def engines() -> Iterator[Any]:
    made: list[str] = []

    def make(config: Any) -> Any:
        instance = f"kvoffload-test-{uuid.uuid4().hex[:8]}"
        engine = LMCacheEngineBuilder.get_or_create(
            instance, config, _metadata(), CpuKV(), lambda t, r: None, lambda o, r: o
        )
        engine.post_init()
        made.append(instance)
        return engine

    yield make
    for instance in made:
        LMCacheEngineBuilder.destroy(instance)


def _kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, LAYERS, tokens, HEADS * DIM), generator=g).to(torch.bfloat16)


def _stored(engine: Any, tokens: list[int], expected: int) -> None:
    """Wait until LMCache's asynchronous puts made `expected` tokens visible in the store."""
    for _ in range(3000):
        if engine.lookup(tokens, search_range=[BACKEND]) >= expected:
            return
        time.sleep(0.01)  # LMCache puts in the background
    raise AssertionError("LMCache's puts never reached the store")


def _connector(engine: Any) -> KVOffloadRemoteConnector:
    backend = engine.storage_manager.storage_backends[BACKEND]
    # LMCache wraps every remote connector in its metrics and ref-count layer.
    inner = getattr(backend.connection, "_connector", backend.connection)
    assert isinstance(inner, KVOffloadRemoteConnector)
    return inner


def test_lmcache_stores_and_retrieves_chunks_through_the_daemon(
    start_daemon: Any, engines: Any
) -> None:
    daemon = start_daemon()
    writer = engines(_config(daemon.url()))
    assert BACKEND in writer.storage_manager.storage_backends
    tokens = list(range(100, 164))  # 4 chunks
    kv = _kv(len(tokens), seed=1)
    writer.store(tokens, kv=kv)
    _stored(writer, tokens, len(tokens))

    # Another engine, empty, same store: everything it gets came through the daemon.
    reader = engines(_config(daemon.url()))
    assert reader.lookup(tokens) == len(tokens)
    out = torch.zeros_like(kv)
    got = reader.retrieve(tokens, kv=out)
    assert int(got.sum()) == len(tokens)
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))

    # Prefix queries over partly stored sequences: leading chunks only.
    assert reader.lookup(tokens[:32] + list(range(900, 932))) == 32
    half = list(range(300, 364))
    writer.store(half[:32], kv=_kv(32, seed=2))
    _stored(writer, half[:32], 32)
    assert reader.lookup(half) == 32
    connector = _connector(reader)
    keys = [key for _, _, key in reader.token_database.process_tokens(tokens=half)]
    assert connector.batched_contains(keys) == 2
    assert connector.batched_contains(keys[1:]) == 1  # chunk 1 is there, 2 is not


def test_a_partial_last_chunk_round_trips(start_daemon: Any, engines: Any) -> None:
    daemon = start_daemon()
    writer = engines(_config(daemon.url(), save_unfull_chunk=True))
    tokens = list(range(500, 540))  # 2 full chunks and 8 tokens
    kv = _kv(len(tokens), seed=3)
    writer.store(tokens, kv=kv)
    _stored(writer, tokens, len(tokens))
    reader = engines(_config(daemon.url(), save_unfull_chunk=True))
    out = torch.zeros_like(kv)
    assert int(reader.retrieve(tokens, kv=out).sum()) == len(tokens)
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))


def test_a_damaged_chunk_ends_the_hit_there(start_daemon: Any, engines: Any) -> None:
    daemon = start_daemon()
    writer = engines(_config(daemon.url()))
    tokens = list(range(700, 764))
    kv = _kv(len(tokens), seed=4)
    writer.store(tokens, kv=kv)
    _stored(writer, tokens, len(tokens))
    reader = engines(_config(daemon.url()))
    connector = _connector(reader)
    keys = [key for _, _, key in reader.token_database.process_tokens(tokens=tokens)]
    damage_stored_block(daemon.url(), engine_hashes(connector.namespace, [
        keys[2].to_string().encode()])[0])  # fmt: skip
    out = torch.zeros_like(kv)
    got = reader.retrieve(tokens, kv=out)
    # Chunks 0 and 1 are loaded exactly; the damaged chunk is never copied out.
    assert int(got.sum()) == 2 * CHUNK
    assert torch.equal(out[:, :, : 2 * CHUNK].view(torch.int16),
                       kv[:, :, : 2 * CHUNK].view(torch.int16))  # fmt: skip
    assert not out[:, :, 2 * CHUNK : 3 * CHUNK].any()


def test_chunk_layouts_do_not_mix(start_daemon: Any, engines: Any) -> None:
    daemon = start_daemon()
    writer = engines(_config(daemon.url()))
    tokens = list(range(40, 72))
    writer.store(tokens, kv=_kv(len(tokens), seed=5))
    _stored(writer, tokens, len(tokens))
    salted = engines(_config(daemon.url(), extra={"remote_storage_plugin.kvoffload.salt": "b"}))
    assert salted.lookup(tokens) == 0


def test_bad_plugin_settings_are_refused(engines: Any) -> None:
    class Backend:
        config = _config("kv://127.0.0.1:9")
        metadata = _metadata()

    bad = _config("kv://127.0.0.1:9", extra={"remote_storage_plugin.kvoffload.typo": 1})
    with pytest.raises(ConfigError, match="unknown key"):
        KVOffloadRemoteConnector(loop=None, local_cpu_backend=Backend(), config=bad)  # type: ignore[arg-type]
    empty = _config("")
    with pytest.raises(ConfigError, match="url"):
        KVOffloadRemoteConnector(loop=None, local_cpu_backend=Backend(), config=empty)  # type: ignore[arg-type]
