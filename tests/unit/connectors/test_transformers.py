"""The transformers adapter on real tensors and a real DynamicCache (no model weights)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvoffload.client_sdk import Client, Namespace, block_keys  # noqa: E402
from kvoffload.client_sdk.transports.local import LocalTransport  # noqa: E402
from kvoffload.connectors.transformers import TransformersKV  # noqa: E402
from kvoffload.kvstore import DramConfig, Engine, EngineConfig  # noqa: E402

NS = Namespace("test/tiny", dtype="bfloat16", block_tokens=4, num_layers=3, num_kv_heads=2,
               head_size=8)  # fmt: skip


def _cache(tokens: int) -> DynamicCache:
    g = torch.Generator().manual_seed(tokens)
    pairs = [
        (torch.randn(1, 2, tokens, 8, generator=g).bfloat16(),
         torch.randn(1, 2, tokens, 8, generator=g).bfloat16())
        for _ in range(3)
    ]  # fmt: skip
    return DynamicCache(pairs)


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.fixture
def engine() -> Engine:
    with Engine(EngineConfig(DramConfig(capacity_bytes=8 << 20, prefault=False))) as e:
        yield e


@pytest.mark.parametrize("codec", ["none", "split-zstd", "zstd"])
def test_store_then_load_is_bit_exact(engine: Engine, codec: str) -> None:
    client = Client(LocalTransport(engine, owned=False), namespace=NS, codec=codec)
    kv = TransformersKV(client, NS)
    ids = list(range(1000, 1019))  # 19 tokens: 4 full blocks
    cache = _cache(19)
    assert kv.store(ids, cache) == (4, 4 * NS.block_bytes)
    assert kv.store(ids, cache) == (0, 0)  # already stored
    loaded = kv.load(ids + [7])
    assert loaded.tokens == 16 and loaded.bytes == 4 * NS.block_bytes
    for (k0, v0), (k1, v1) in zip(_layers(cache), _layers(loaded.cache), strict=True):
        assert torch.equal(k0[:, :, :16], k1) and torch.equal(v0[:, :, :16], v1)
    # At least one token is always left to compute.
    assert kv.load(ids[:16]).tokens == 12


def test_load_stops_at_a_corrupt_block(engine: Engine) -> None:
    client = Client(LocalTransport(engine, owned=False), namespace=NS)
    kv = TransformersKV(client, NS)
    ids = list(range(17))
    kv.store(ids, _cache(17))
    third = block_keys(NS, ids)[2]
    with engine.get(third) as view:
        damaged = bytearray(view.data)
    damaged[200] ^= 0x40
    engine.put(third, damaged)
    loaded = kv.load(ids)
    assert loaded.tokens == 8  # blocks 0 and 1 only: never the damaged bytes
    assert client.stats().corrupt_blocks == 1
    assert kv.load([5, 6, 7, 8, 9]).cache is None


def test_a_lossy_namespace_loads_close_to_the_stored_cache(engine: Engine) -> None:
    ns = dataclasses.replace(NS, codec="fp8")
    client = Client(LocalTransport(engine, owned=False), namespace=ns)
    kv = TransformersKV(client, ns)
    ids = list(range(2000, 2013))
    cache = _cache(13)
    kv.store(ids, cache)
    loaded = kv.load(ids)
    assert loaded.tokens == 12
    for (k0, v0), (k1, v1) in zip(_layers(cache), _layers(loaded.cache), strict=True):
        for exact, approx in ((k0[:, :, :12], k1), (v0[:, :, :12], v1)):
            error = (approx.float() - exact.float()).norm() / exact.float().norm()
            assert 0 < error < 0.05
    stats = client.stats()  # 768-byte blocks: the 96-byte header and the scales weigh in
    assert stats.bytes_stored < stats.bytes_put
