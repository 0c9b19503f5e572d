"""Codecs through the SDK: encode on put, decode on get, over every transport.

Tests take a `url` fixture and run against every transport in `TRANSPORTS`: local://, and a
live daemon over kv:// and over nvme+tcp://. Blocks with chosen bytes are injected
through the transport itself, so no test depends on one store's internals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import struct

import numpy as np
import pytest
from kvdata import as_float32, make_kv_block

from kvoffload.client_sdk import AsyncClient, Client, Namespace, block_keys
from kvoffload.compression import get_codec
from kvoffload.compression.base import PREAMBLE_BYTES, Preamble
from kvoffload.compression.lossless import _part_count
from kvoffload.errors import (
    CodecError,
    CodecMismatchError,
    InvalidArgumentError,
    UnsupportedCodecConfigError,
)
from kvoffload.wire.block import HEADER_BYTES, seal

# "kv" runs against a live daemon (tests/conftest.py), so it carries the integration mark.
TRANSPORTS = [
    "local://?dram=64MiB&prefault=0",
    pytest.param("kv", marks=pytest.mark.integration),
    pytest.param("nvme", marks=pytest.mark.integration),
]
NS = Namespace("org/model", dtype="bfloat16", block_tokens=16, num_layers=4, num_kv_heads=2,
               head_size=64)  # fmt: skip
LOSSLESS = ["none", "lz4", "zstd", "split-lz4", "split-zstd"]


@pytest.fixture(params=TRANSPORTS)
def url(request: pytest.FixtureRequest) -> str:
    if request.param in ("kv", "nvme"):  # a fresh daemon per test: tests assume an empty store
        daemon = request.getfixturevalue("start_daemon")()
        return str(daemon.url() if request.param == "kv" else daemon.nvme_url())
    return str(request.param)


def _untouched_or_zeroed(out: np.ndarray, fill: int) -> bool:
    """`out` still holds `fill`, except perhaps a zeroed prefix."""
    zeroed = int(np.argmax(out != 0)) if out.size and out[0] == 0 else 0
    return bool(np.all(out[:zeroed] == 0) and np.all(out[zeroed:] == fill))


def _block(seed: int, ns: Namespace = NS) -> np.ndarray:
    return make_kv_block(ns.dtype, ns.block_spec.shape or (), seed)


def _inject(client: Client, key: bytes, payload: bytes, codec_id: int, raw_length: int) -> None:
    """Store a block with a valid header and checksum around any payload."""
    header = seal(
        key_or_hash=key,
        payload=payload,
        stored_length=len(payload),
        raw_length=raw_length,
        namespace=NS.fingerprint,
        codec_id=codec_id,
    )
    client.transport.put(key, [header, payload], None)


@pytest.mark.parametrize("codec", LOSSLESS)
def test_lossless_blocks_come_back_bit_exact(url: str, codec: str) -> None:
    keys = block_keys(NS, list(range(4 * NS.block_tokens)))
    blocks = [_block(i) for i in range(len(keys))]
    with Client.connect(url, namespace=NS, codec=codec) as client:
        assert client.codec.name == codec
        client.put_many(zip(keys, blocks, strict=True), parents=[None, *keys[:-1]])
        out = np.empty(NS.block_bytes + 100, np.uint8)  # a larger buffer keeps its tail
        out[-100:] = 7
        for key, block in zip(keys, blocks, strict=True):
            assert client.get_into(key, out) == NS.block_bytes
            assert np.array_equal(out[: NS.block_bytes], block) and np.all(out[-100:] == 7)
            assert client.get(key) == block.tobytes()
        stats = client.stats()
        as_bytearray = bytearray(NS.block_bytes)
        assert client.get_into(keys[0], as_bytearray) == NS.block_bytes
        assert as_bytearray == blocks[0].tobytes()
    raw = len(keys) * NS.block_bytes
    assert stats.bytes_put == raw and stats.bytes_got == 2 * raw
    assert stats.bytes_fetched == 2 * stats.bytes_stored
    assert stats.codec_errors == stats.corrupt_blocks == stats.misses == 0
    if codec.startswith("split"):
        assert stats.bytes_stored < raw / (1.2 if codec == "split-zstd" else 1.03)
    if codec == "none":
        assert stats.bytes_stored == raw + HEADER_BYTES * len(keys)


def test_any_reader_decodes_and_lossless_codecs_keep_keys(url: str) -> None:
    """The codec is in the header: a reader with no codec and no namespace decodes, and a
    namespace naming a lossless codec has the same keys as one without."""
    compressed_ns = dataclasses.replace(NS, codec="split-zstd")
    key = block_keys(compressed_ns, list(range(NS.block_tokens)))[0]
    assert key == block_keys(NS, list(range(NS.block_tokens)))[0]
    block = _block(1)
    with Client.connect(url, namespace=compressed_ns) as writer:
        assert writer.codec.name == "split-zstd"
        writer.put(key, block)
        assert writer.stats().bytes_stored < NS.block_bytes
        plain = Client(writer.transport)  # same store, no namespace, default codec
        assert plain.codec.name == "none" and plain.get(key) == block.tobytes()
        exact = Client(writer.transport, namespace=NS)
        assert exact.get(key) == block.tobytes()


def test_tensors_and_typed_arrays_without_a_namespace(url: str) -> None:
    torch = pytest.importorskip("torch")
    values = torch.randn(8, 2, 3, 16, 64, generator=torch.Generator().manual_seed(0))
    with Client.connect(url, codec="split-zstd") as client:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            tensor = values.to(dtype)
            client.put(bytes(16), tensor)  # the planes follow the tensor's own dtype
            out = torch.empty_like(tensor)
            assert client.get_into(bytes(16), out) == tensor.numel() * tensor.element_size()
            assert torch.equal(out, tensor)
        client.put(bytes(16), b"odd-length bytes!")  # untyped: one plane
        assert client.get(bytes(16)) == b"odd-length bytes!"


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_lossy_blocks_come_back_within_bounds(url: str, codec: str) -> None:
    lossy = dataclasses.replace(NS, codec=codec)
    keys = block_keys(lossy, list(range(2 * NS.block_tokens)))
    assert keys != block_keys(NS, list(range(2 * NS.block_tokens)))  # part of block identity
    blocks = [_block(i) for i in range(len(keys))]
    with Client.connect(url, namespace=lossy) as client:
        for key, block in zip(keys, blocks, strict=True):
            client.put(key, block)
        out = np.empty(NS.block_bytes, np.uint8)
        for key, block in zip(keys, blocks, strict=True):
            assert client.get_into(key, out) == NS.block_bytes
            x, y = as_float32(block, "bfloat16"), as_float32(out, "bfloat16")
            relative = np.linalg.norm(y - x) / np.linalg.norm(x)
            assert 0 < relative < (0.05 if codec == "fp8" else 0.15)
        stats = client.stats()
        # A reader of exact KV never receives lossy blocks, even under the same key.
        exact = Client(client.transport, namespace=NS)
        assert exact.get(keys[0]) is None and exact.stats().corrupt_blocks == 1
    assert stats.bytes_stored < stats.bytes_put / (1.9 if codec == "fp8" else 2.5)


def test_lossy_codecs_must_be_declared_by_the_namespace(url: str) -> None:
    with pytest.raises(UnsupportedCodecConfigError, match="Namespace"):
        Client.connect(url, namespace=NS, codec="fp8")
    with pytest.raises(UnsupportedCodecConfigError, match="Namespace"):
        Client.connect(url, codec="int4")
    with pytest.raises(UnsupportedCodecConfigError, match="declares the lossy codec 'fp8'"):
        Client.connect(url, namespace=dataclasses.replace(NS, codec="fp8"), codec="zstd")
    with pytest.raises(UnsupportedCodecConfigError, match="unknown codec"):
        Client.connect(url, codec="gzip")


def test_values_that_do_not_fit_the_codec_are_refused(url: str) -> None:
    lossy = dataclasses.replace(NS, codec="fp8")
    with Client.connect(url, namespace=lossy) as client:
        with pytest.raises(CodecMismatchError, match="not one block"):
            client.put(bytes(16), _block(0)[:-64])
        with pytest.raises(InvalidArgumentError):  # a CodecMismatchError is one too
            client.put(bytes(16), b"short")
        assert client.stats().puts == 0 and not client.exists(bytes(16))
    with Client.connect(url, namespace=NS, codec="split-zstd") as client:
        as_f32 = np.zeros(NS.block_bytes // 4, np.float32)
        with pytest.raises(CodecMismatchError, match="float32 does not match.*bfloat16"):
            client.put(bytes(16), as_f32)
        client.put(bytes(16), as_f32.view(np.uint8))  # raw bytes claim no dtype
        assert client.get(bytes(16)) == as_f32.tobytes()


def test_incompressible_values_are_stored_raw(url: str) -> None:
    noise = make_kv_block("uint8", (100_000,), seed=3)
    with Client.connect(url, codec="zstd") as client:
        client.put(bytes(16), noise)
        assert client.get(bytes(16)) == noise.tobytes()
        stats = client.stats()
    assert stats.bytes_stored == stats.bytes_put + HEADER_BYTES


def test_unknown_codec_id_from_the_store_is_a_counted_miss(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with Client.connect(url, namespace=NS) as client:
        _inject(client, bytes(16), b"from a newer writer", codec_id=999, raw_length=64)
        buffer = bytearray(b"x" * 64)
        with caplog.at_level(logging.WARNING):
            assert client.get(bytes(16)) is None
            assert client.get_into(bytes(16), buffer) is None
        # Nothing decoded: untouched (local://), or where the transport had received the
        # payload straight into the buffer (kv://), zeroed again.
        assert bytes(buffer) in (b"x" * 64, bytes(19) + b"x" * 45)
        stats = client.stats()
    assert stats.codec_errors == 2 and stats.misses == 2 and stats.hits == 0
    assert "unknown codec id 999" in caplog.text


def test_a_payload_that_fails_to_decode_is_a_miss_and_leaves_no_partial_data(url: str) -> None:
    block = _block(4)
    payload = bytearray(bytes(get_codec("split-zstd").encode(block, NS.block_spec)))
    payload[-200:] = bytes(200)  # damage the compressed planes, then seal a valid checksum
    with Client.connect(url, namespace=NS) as client:
        _inject(client, bytes(16), bytes(payload), codec_id=4, raw_length=block.size)
        _inject(client, bytes(range(16)), b"\x01" * 40, codec_id=2, raw_length=block.size)
        out = np.full(NS.block_bytes, 0xAB, np.uint8)
        for key in (bytes(16), bytes(range(16))):
            assert client.get_into(key, out) is None
            assert not np.any(out), "a failed decode leaves zeros, never half-decoded KV"
            assert client.get(key) is None
        assert client.stats().codec_errors == 4


def test_damaged_compressed_block_fails_its_checksum_before_decoding(url: str) -> None:
    with Client.connect(url, namespace=NS, codec="split-zstd") as client:
        key = bytes(range(16))
        client.put(key, _block(5))
        held = client.transport.get(key)
        assert held is not None
        stored = bytearray(held.data)
        held.release()
        stored[HEADER_BYTES + 40] ^= 0x10
        client.transport.put(key, [bytes(stored)], None)
        out = np.full(NS.block_bytes, 0xAB, np.uint8)
        assert client.get_into(key, out) is None
        # local:// verifies before a byte is written; kv:// receives straight into the
        # buffer and zeroes what it received when verification fails. Never block bytes.
        assert _untouched_or_zeroed(out, 0xAB)
        stats = client.stats()
        assert stats.corrupt_blocks == 1 and stats.codec_errors == 0


def test_absurd_raw_length_is_refused_before_allocating(url: str) -> None:
    with Client.connect(url, namespace=NS) as client:
        _inject(client, bytes(16), b"tiny", codec_id=2, raw_length=1 << 50)
        assert client.get(bytes(16)) is None
        assert client.stats().corrupt_blocks == 1


def test_async_client_encodes_and_decodes(url: str) -> None:
    async def main() -> None:
        async with AsyncClient.connect(url, namespace=NS, codec="split-zstd") as client:
            keys = block_keys(NS, list(range(3 * NS.block_tokens)))
            blocks = [_block(i) for i in range(3)]
            await client.put_many(zip(keys, blocks, strict=True), parents=[None, *keys[:-1]])
            got = await asyncio.gather(*(client.get(k) for k in keys))
            assert got == [b.tobytes() for b in blocks]
            out = np.empty(NS.block_bytes, np.uint8)
            assert await client.get_into(keys[1], out) == NS.block_bytes
            assert np.array_equal(out, blocks[1])
            stats = await client.stats()
            assert stats.bytes_stored < stats.bytes_put and client.codec.name == "split-zstd"

    asyncio.run(main())


def test_a_codec_instance_with_options(url: str) -> None:
    codec = get_codec("split-zstd", threads=2, part_bytes=4096)
    with Client.connect(url, namespace=NS, codec=codec) as client:
        assert client.codec is codec
        client.put(bytes(16), _block(6))
        assert client.get(bytes(16)) == _block(6).tobytes()


def _with_segment(payload: bytes, segment: bytes) -> bytes:
    """A one-segment lossless payload with its segment replaced (table length updated)."""
    table = PREAMBLE_BYTES + 8
    n_parts, _ = struct.unpack_from("<II", payload, PREAMBLE_BYTES)
    assert n_parts == 1
    (length,) = struct.unpack_from("<I", payload, table)
    head = bytearray(payload[: table + 5])  # preamble, counts, one length, one method byte
    struct.pack_into("<I", head, table, len(segment))
    assert len(payload) == table + 5 + length  # no raw tail for a byte codec
    return bytes(head) + segment


def test_a_zstd_frame_claiming_a_huge_size_is_refused_before_allocating(url: str) -> None:
    raw = np.zeros(4096, np.uint8)
    payload = bytes(get_codec("zstd").encode(raw))
    # A valid zstd frame header declaring a terabyte of content, with one empty raw block:
    # zstandard would allocate the terabyte before noticing.
    lie = b"\x28\xb5\x2f\xfd" + b"\xe0" + (1 << 40).to_bytes(8, "little") + b"\x01\x00\x00"
    with pytest.raises(CodecError, match="declares"):
        get_codec("zstd").decode(_with_segment(payload, lie), limit=4096)
    with Client.connect(url) as client:
        _inject_plain(client, bytes(16), _with_segment(payload, lie), codec_id=2, raw=4096)
        assert client.get(bytes(16)) is None
        assert client.stats().codec_errors == 1


def _inject_plain(client: Client, key: bytes, payload: bytes, codec_id: int, raw: int) -> None:
    header = seal(key_or_hash=key, payload=payload, stored_length=len(payload),
                  raw_length=raw, namespace=None, codec_id=codec_id)  # fmt: skip
    client.transport.put(key, [header, payload], None)


def test_a_tiny_payload_cannot_claim_millions_of_parts() -> None:
    import tracemalloc

    codec = get_codec("split-zstd")
    payload = bytearray(bytes(codec.encode(np.zeros(4 << 20, np.uint8))))
    head = Preamble.unpack(np.frombuffer(bytes(payload), np.uint8))
    elements = head.raw_length // head.param
    # Four million 1-byte parts, as many as the layout allows, so the count check passes:
    # only the payload's size (5 table bytes per part and plane) may refuse it, and it must
    # do so before a single part is built.
    struct.pack_into("<II", payload, PREAMBLE_BYTES, _part_count(head.spec, elements, 1), 1)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="segment table"):
            codec.decode(bytes(payload[:200]), limit=4 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20  # building the parts first took ~800 MiB


def test_crafted_lossy_payloads_never_decode_to_nan_or_overflow() -> None:
    codec = get_codec("fp8")
    spec = NS.block_spec
    payload = bytearray(bytes(codec.encode(_block(2), spec)))
    body = len(payload) - _block(2).size // 2  # fp8 codes follow the preamble and scales
    nan = bytearray(payload)
    nan[body + 5] = 0x7F  # an e4m3 NaN code
    with pytest.raises(CodecError, match="cannot hold"):
        codec.decode(bytes(nan))
    huge = bytearray(payload)
    huge[body - 4 : body] = np.float32(3e38).tobytes()  # a scale far above dtype max / 448
    with pytest.raises(CodecError, match="cannot hold"):
        codec.decode(bytes(huge))


def test_lossy_blocks_reach_only_readers_that_declared_them(url: str) -> None:
    lossy = dataclasses.replace(NS, codec="fp8")
    key = block_keys(NS, list(range(NS.block_tokens)))[0]
    with Client.connect(url, namespace=lossy) as writer:
        writer.put(key, _block(1))
        raw = writer.transport.get(key)
        assert raw is not None
        stored = bytes(raw.data)
        raw.release()
    with Client.connect(url, namespace=NS) as reader:  # exact-KV reader, same key and bytes
        header = seal(key_or_hash=key, payload=stored[HEADER_BYTES:],
                      stored_length=len(stored) - HEADER_BYTES, raw_length=NS.block_bytes,
                      namespace=NS.fingerprint, codec_id=16)  # fmt: skip
        reader.transport.put(key, [header, stored[HEADER_BYTES:]], None)
        assert reader.get(key) is None
        assert reader.stats().codec_errors == 1


def test_malformed_batches_are_invalid_arguments(url: str) -> None:
    with Client.connect(url) as client:
        with pytest.raises(InvalidArgumentError):
            client.put_many([(bytes(16),)])  # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError):
            client.get_many(None)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            client.lookup(7)  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", ["none", "split-zstd"])
def test_get_many_into_fills_each_buffer_or_reports_a_miss(url: str, codec: str) -> None:
    keys = block_keys(NS, list(range(5 * NS.block_tokens)))
    blocks = [_block(20 + i) for i in range(len(keys))]
    missing = bytes(range(1, 17))
    damaged = bytes(range(2, 18))
    with Client.connect(url, namespace=NS, codec=codec) as client:
        client.put_many(zip(keys, blocks, strict=True), parents=[None, *keys[:-1]])
        client.put(damaged, _block(9))
        held = client.transport.get(damaged)
        assert held is not None
        stored = bytearray(held.data)
        held.release()
        stored[-1] ^= 0x01  # the checksum no longer matches
        client.transport.put(damaged, [bytes(stored)], None)
        asked = [keys[0], missing, *keys[1:], damaged]
        outs = [np.full(NS.block_bytes + 8, 0xAB, np.uint8) for _ in asked]
        got = client.get_many_into(asked, outs)
        assert got[0] == NS.block_bytes and got[2:-1] == [NS.block_bytes] * (len(keys) - 1)
        assert got[1] is None and got[-1] is None
        for out, block in zip([outs[0], *outs[2:-1]], blocks, strict=True):
            assert np.array_equal(out[: NS.block_bytes], block) and np.all(out[-8:] == 0xAB)
        assert np.all(outs[1] == 0xAB)  # a miss leaves its buffer alone ...
        assert _untouched_or_zeroed(outs[-1], 0xAB)  # ... a damaged block leaves no KV there
        with pytest.raises(InvalidArgumentError, match="buffers"):
            client.get_many_into(keys, outs[:2])
        with pytest.raises(InvalidArgumentError, match="too small"):
            client.get_many_into(keys[:3], [outs[0], np.empty(10, np.uint8), outs[2]])
        if url.startswith("local://"):  # the blocks held for the batch were all released
            assert client.stats().store["tiers"][0]["pinned"] == 0  # type: ignore[index]
        assert client.get_many_into([], []) == []

        async def main() -> None:
            async with AsyncClient.connect(url, namespace=NS, codec=codec) as aclient:
                many = [np.empty(NS.block_bytes, np.uint8) for _ in keys]
                assert await aclient.get_many_into(keys, many) == [NS.block_bytes] * len(keys)
                assert all(np.array_equal(o, b) for o, b in zip(many, blocks, strict=True))

        if not url.startswith("local://"):  # local:// is one process's store
            asyncio.run(main())
