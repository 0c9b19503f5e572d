from __future__ import annotations

import asyncio
import logging
import os

import numpy as np
import pytest

from kvoffload.client_sdk import AsyncClient, Client, Namespace, block_hashes, block_keys
from kvoffload.client_sdk.transports.local import LocalTransport
from kvoffload.errors import InvalidArgumentError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig
from kvoffload.wire.block import HEADER_BYTES

NS = Namespace("org/model", block_tokens=4, num_layers=2, num_kv_heads=2, head_size=8)
URL = "local://?dram=8MiB&prefault=0"


@pytest.fixture
def client() -> Client:
    with Client.connect(URL, namespace=NS) as c:
        yield c


def test_default_connect_is_an_embedded_store() -> None:
    with Client.connect() as c:
        c.put(bytes(16), b"v")
        assert c.get(bytes(16)) == b"v"
        tier = c.stats().store["tiers"][0]  # type: ignore[index]
        assert tier["capacity_bytes"] == 1 << 30


def test_chain_round_trip(client: Client) -> None:
    keys = block_keys(NS, list(range(40)))
    blocks = [
        np.random.default_rng(i).integers(0, 255, NS.block_bytes, dtype=np.uint8)
        for i in range(len(keys))
    ]
    client.put_many(zip(keys, blocks, strict=True), parents=[None, *keys[:-1]])
    assert client.lookup(keys) == len(keys)
    assert client.exists(keys[3])
    out = np.empty(NS.block_bytes, dtype=np.uint8)
    for k, b in zip(keys, blocks, strict=True):
        assert client.get_into(k, out) == NS.block_bytes
        assert np.array_equal(out, b)
    assert client.get_many(keys[:2]) == [blocks[0].tobytes(), blocks[1].tobytes()]
    assert client.delete(keys[5])
    assert client.lookup(keys) == 5
    assert client.prefetch(keys) == len(keys) - 1
    stats = client.stats()
    assert stats.puts == len(keys) and stats.corrupt_blocks == 0
    assert stats.bytes_stored == stats.bytes_put + HEADER_BYTES * len(keys)


def test_full_hashes_work_as_keys(client: Client) -> None:
    hashes = block_hashes(NS, list(range(8)))
    client.put(hashes[0], b"a")
    assert client.get(hashes[0]) == b"a"
    assert client.get(hashes[0][:16]) == b"a"


def test_miss_is_none(client: Client) -> None:
    assert client.get(bytes(16)) is None
    assert client.get_into(bytes(16), bytearray(8)) is None
    assert client.exists(bytes(16)) is False
    assert client.stats().misses == 2


def test_bad_arguments_leave_the_store_unchanged(client: Client) -> None:
    client.put(bytes(16), b"keep")
    with pytest.raises(InvalidArgumentError):
        client.put(b"short", b"v")
    with pytest.raises(InvalidArgumentError):
        client.put(bytes(16), b"v", parent=b"bad")
    with pytest.raises(InvalidArgumentError, match="limit"):
        client.put(bytes(16), bytes(8 << 20))
    with pytest.raises(InvalidArgumentError):
        client.put(bytes(16), object())
    with pytest.raises(InvalidArgumentError, match="too small"):
        client.get_into(bytes(16), bytearray(2))
    assert client.get(bytes(16)) == b"keep"
    assert client.stats().puts == 1


def _shared() -> tuple[Engine, Client, Client]:
    engine = Engine(EngineConfig(DramConfig(capacity_bytes=8 << 20, prefault=False)))
    return (
        engine,
        Client(LocalTransport(engine, owned=False), namespace=NS),
        Client(LocalTransport(engine, owned=False)),
    )


def test_corrupt_block_is_a_counted_logged_miss(caplog: pytest.LogCaptureFixture) -> None:
    engine, client, _ = _shared()
    key = block_keys(NS, list(range(4)))[0]
    payload = os.urandom(1000)
    client.put(key, payload)
    with engine.get(key) as view:
        stored = bytearray(view.data)
    stored[-1] ^= 0x01  # one flipped bit in the payload
    engine.put(key, stored)
    with caplog.at_level(logging.WARNING):
        assert client.get(key) is None
        buf = bytearray(1000)
        assert client.get_into(key, buf) is None
    assert buf == bytearray(1000), "no byte of a corrupt block may reach the caller"
    stats = client.stats()
    assert stats.corrupt_blocks == 2 and stats.misses == 2 and stats.hits == 0
    assert "failed verification" in caplog.text and "checksum" in caplog.text
    engine.close()


def test_block_of_another_namespace_is_a_miss() -> None:
    engine, client, plain = _shared()
    plain.put(bytes(16), b"written without a namespace")
    assert plain.get(bytes(16)) == b"written without a namespace"
    assert client.get(bytes(16)) is None
    assert client.stats().corrupt_blocks == 1
    engine.put(bytes(range(16)), b"raw bytes, no header at all")
    assert plain.get(bytes(range(16))) is None
    engine.close()


def test_async_client_mirrors_the_sync_one() -> None:
    async def main() -> None:
        async with AsyncClient.connect(URL, namespace=NS) as client:
            keys = block_keys(NS, list(range(16)))
            await client.put_many(
                [(k, bytes([i]) * 100) for i, k in enumerate(keys)], parents=[None, *keys[:-1]]
            )
            assert await client.lookup(keys) == 4
            assert await client.get(keys[2]) == bytes([2]) * 100
            buf = bytearray(100)
            assert await client.get_into(keys[3], buf) == 100 and buf == bytes([3]) * 100
            results = await asyncio.gather(*(client.get(k) for k in keys))
            assert results == [bytes([i]) * 100 for i in range(4)]
            assert await client.exists(keys[0]) and await client.delete(keys[0])
            assert await client.get(keys[0]) is None
            assert await client.prefetch(keys) == 3
            assert (await client.get_many(keys[1:3]))[0] == bytes([1]) * 100
            stats = await client.stats()
            assert stats.puts == 4 and stats.misses == 1

    asyncio.run(main())
