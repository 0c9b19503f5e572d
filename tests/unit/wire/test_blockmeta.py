"""Block metadata: its byte form and bounds, how Put and PutMany carry it (protocol 3, never
sent to a protocol-2 daemon), and a put through the SDK reaching the engine with it."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from kvoffload.client_sdk import BlockMeta, Client
from kvoffload.client_sdk.transports.native import plans
from kvoffload.errors import InvalidArgumentError, LocalProtocolError
from kvoffload.wire.blockmeta import MAX_META_BYTES, MAX_META_TOKENS, check_meta
from kvoffload.wire.native.connection import Put, PutMany

K1, K2 = bytes(16), bytes(range(16))


@pytest.mark.parametrize(
    "meta",
    [
        BlockMeta(),
        BlockMeta(tuple(range(16)), block_hash=0, parent_hash=(1 << 64) - 1),
        BlockMeta((0xFFFFFFFF,) * MAX_META_TOKENS, lora_name="é" * 64, cache_salt="s" * 128),
        BlockMeta([5, 6], lora_name="", block_size=256),  # a list becomes a tuple
    ],
)
def test_byte_form_round_trips(meta: BlockMeta) -> None:
    data = meta.encode()
    assert len(data) <= MAX_META_BYTES
    assert BlockMeta.decode(data) == meta and check_meta(data) == data


@pytest.mark.parametrize(
    "fields",
    [
        {"token_ids": tuple(range(MAX_META_TOKENS + 1))},
        {"token_ids": (1 << 32,)},
        {"token_ids": (-1,)},
        {"token_ids": ("a",)},
        {"block_hash": 1 << 64},
        {"parent_hash": -1},
        {"lora_name": "x" * 129},
        {"cache_salt": 5},
        {"block_size": -1},
    ],
)
def test_out_of_bounds_metadata_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockMeta(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "data",
    [b"", b"\x01", BlockMeta((1, 2)).encode()[:-1], BlockMeta((1, 2)).encode() + b"\0",
     b"\x02" + BlockMeta().encode()[1:], bytes(MAX_META_BYTES + 1)],
)  # fmt: skip
def test_malformed_byte_forms_are_protocol_errors(data: bytes) -> None:
    with pytest.raises(LocalProtocolError):
        check_meta(data)


def test_frames_without_metadata_have_no_metadata_field() -> None:
    # A protocol-2 daemon refuses fields it does not know: a put without metadata must look
    # exactly as it did.
    assert "block_meta" not in Put(1, K1, 3).meta()
    assert "block_metas" not in PutMany(1, (K1,), (3,)).meta()
    assert Put(1, K1, 3, block_meta=BlockMeta().encode()).meta()["block_meta"]
    with pytest.raises(LocalProtocolError, match="metadata"):
        PutMany(1, (K1, K2), (1, 1), block_metas=(None,))
    with pytest.raises(LocalProtocolError):
        Put(1, K1, 3, block_meta=b"junk")
    assert msgpack.packb(Put(1, K1, 3).meta())  # still one plain map


def test_metadata_is_stripped_for_a_protocol_2_daemon() -> None:
    meta = BlockMeta((1,)).encode()
    items = [(K1, [b"a"], None, meta), (K2, [b"b"], K1, None)]
    assert plans.metadata_for(3, items) is items
    assert [item[3] for item in plans.metadata_for(2, items)] == [None, None]


def test_local_puts_keep_metadata_with_the_block(tmp_path: Path) -> None:
    meta = BlockMeta(tuple(range(16)), block_hash=42)
    with Client.connect(f"local://{tmp_path}?dram=8MiB&ssd=16MiB") as client:
        client.put(K1, b"value", meta=meta, durable=True)
        client.put_many([(K2, b"v2")], parents=[K1], metas=[BlockMeta((9,))])
        engine = client.transport.engine  # type: ignore[attr-defined]
        assert BlockMeta.decode(engine.meta_of(K1)) == meta
        assert BlockMeta.decode(engine.meta_of(K2)) == BlockMeta((9,))
        with pytest.raises(InvalidArgumentError, match="metadata entries"):
            client.put_many([(K1, b"x")], metas=[])
        with pytest.raises(InvalidArgumentError, match="BlockMeta"):
            client.put(K1, b"x", meta=b"raw")  # type: ignore[arg-type]
        assert client.get(K1) == b"value"  # the refused puts changed nothing
    with Client.connect(f"local://{tmp_path}?dram=8MiB") as client:  # reopened from the store
        engine = client.transport.engine  # type: ignore[attr-defined]
        assert BlockMeta.decode(engine.meta_of(K1)) == meta
