"""KV events a KV-aware router can index: puts carry block metadata (token ids, the serving
engine's hashes), `BlockStored` publishes it, and a router that hashes tokens the way Dynamo
does rebuilds from the event stream, and after a restart from a replay request, an index that
answers "longest stored prefix" exactly as the store's `lookup` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from dynamo_index import DynamoIndex, local_hashes, sequence_hashes

from kvoffload.bench.trace.workload import TraceShape, chain_keys, generate
from kvoffload.client_sdk import BlockMeta, Client, Namespace

pytestmark = pytest.mark.integration

BLOCK_TOKENS = 16
# ~240 distinct blocks of 64 KiB: more than 4 MiB of DRAM and 8 MiB of SSD hold.
VALUE = 64 << 10
# The probe block's tokens are outside any vocabulary: they never match a trace's.
PROBE = BlockMeta((0xFFFFFFFF,) * BLOCK_TOKENS)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENV = {
    "KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1",
    "KVOFFLOAD_EVENTS__REPLAY_ENDPOINT": "tcp://127.0.0.1:*",
}


def _start(start_daemon: Any, data: Path) -> tuple[Any, str]:
    daemon = start_daemon("--events", "tcp://127.0.0.1:*", "--dram", "4MiB", "--ssd", "8MiB",
                          "--data-dir", str(data), env=ENV)  # fmt: skip
    (replay,) = [line.rsplit(" ", 1)[1] for line in daemon.lines if "events replay on" in line]
    return daemon, replay


def _drain(sub: zmq.Socket[bytes], index: DynamoIndex, quiet_ms: int = 1500) -> int:
    """Apply events until none came for `quiet_ms`; returns how many messages came."""
    messages = 0
    while sub.poll(quiet_ms):
        topic, seq, payload = sub.recv_multipart()
        index.apply(msgpack.unpackb(payload)[1])
        messages += 1
    return messages


def _subscribe(endpoint: str, client: Client, probe: bytes) -> zmq.Socket[bytes]:
    """A subscriber that is known to receive: PUB drops until the subscription propagated."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    for _ in range(200):
        client.put(probe, b"p", meta=PROBE)
        if sub.poll(100):
            break
    return sub


def test_a_dynamo_style_router_rebuilds_the_store_s_prefixes(
    start_daemon: Any, tmp_path: Path
) -> None:
    shape = TraceShape(sessions=16, turns=(2, 5), system_prompts=2, system_tokens=(40, 120),
                       first_message_mean=40, output_tokens=(20, 60), documents=2,
                       document_tokens=(200, 400), questions=(1, 2))  # fmt: skip
    trace = generate(shape, seed=5)
    namespace = Namespace("router-test", block_tokens=BLOCK_TOKENS)
    chains = chain_keys(trace.requests, namespace)
    daemon, replay = _start(start_daemon, tmp_path / "data")
    index = DynamoIndex()
    with Client.connect(daemon.url()) as client:
        sub = _subscribe(daemon.events, client, bytes(range(16)))
        for request, keys in zip(trace.requests, chains, strict=True):
            hit = client.lookup(keys)
            tokens = np.asarray(request.tokens)
            locals_ = local_hashes(tokens, BLOCK_TOKENS)
            seqs = sequence_hashes(locals_)  # the "engine's" own chained hashes
            todo = range(hit, len(keys))
            blocks = tokens[: len(keys) * BLOCK_TOKENS].reshape(-1, BLOCK_TOKENS).tolist()
            metas = [BlockMeta(tuple(blocks[i]), block_hash=seqs[i],
                               parent_hash=seqs[i - 1] if i else None) for i in todo]  # fmt: skip
            client.put_many([(keys[i], bytes([i % 251]) * VALUE) for i in todo],
                            parents=[keys[i - 1] if i else None for i in todo],
                            metas=metas)  # fmt: skip
        assert _drain(sub, index) > 0
        stats = client.stats().store
        tiers = {t["name"]: t for t in stats["tiers"]}  # type: ignore[union-attr]
        assert tiers["dram"]["evictions"] > 0 and tiers["ssd"]["evictions"] > 0  # both churned
        answers = [client.lookup(keys) for keys in chains]
        assert any(0 < a < len(k) for a, k in zip(answers, chains, strict=True))  # partial hits
        assert any(answers)
        for request, answer in zip(trace.requests, answers, strict=True):
            assert index.longest_prefix(request.tokens, BLOCK_TOKENS) == answer
        # The publisher's hashes are the engine's (Dynamo's sequence hashes here).
        for h, node in list(index.nodes.items())[:50]:
            assert h != node.local or node.parent is None
        sub.close(linger=0)
    daemon.stop()

    # A router that starts after the store rebuilds its index from a replay request.
    daemon, replay = _start(start_daemon, tmp_path / "data")
    fresh = DynamoIndex()
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(replay)
    req.send_multipart([b"", (0).to_bytes(8, "big")])
    batches = 0
    while True:
        assert req.poll(20_000), "no replay answer"
        _, seq, payload = req.recv_multipart()
        if seq == END_SEQ:
            break
        fresh.apply(msgpack.unpackb(payload)[1])
        batches += 1
    req.close(linger=0)
    assert batches  # orphans (their parent evicted) are dropped, as `lookup` stops there
    with Client.connect(daemon.url()) as client:
        for request, keys in zip(trace.requests, chains, strict=True):
            assert fresh.longest_prefix(request.tokens, BLOCK_TOKENS) == client.lookup(keys)
        assert sum(client.lookup(keys) for keys in chains) > 0
    assert {m for node in fresh.nodes.values() for m in node.media} == {"STORAGE"}


def test_block_stored_carries_the_metadata(start_daemon: Any, tmp_path: Path) -> None:
    daemon, _ = _start(start_daemon, tmp_path / "data")
    with Client.connect(daemon.url()) as client:
        sub = _subscribe(daemon.events, client, bytes(range(16)))
        while sub.poll(500):
            sub.recv_multipart()
        meta = BlockMeta(tuple(range(100, 116)), block_hash=7, parent_hash=6, lora_name="ada")
        client.put(b"k" * 16, b"value", parent=b"p" * 16, meta=meta)
        client.put(b"n" * 16, b"value", parent=b"k" * 16)  # no metadata: placeholders
        got: list[dict[str, Any]] = []
        while sub.poll(1500):
            got += msgpack.unpackb(sub.recv_multipart()[2])[1]
        with_meta, without = [e for e in got if e["type"] == "BlockStored"]
        assert with_meta["token_ids"] == list(range(100, 116)) and with_meta["block_size"] == 16
        assert with_meta["block_hashes"] == [7] and with_meta["parent_block_hash"] == 6
        assert with_meta["lora_name"] == "ada" and with_meta["medium"] == "CPU"
        assert without["token_ids"] == [] and without["block_size"] == 0
        assert without["block_hashes"] == [int.from_bytes(b"n" * 8, "big")]
        assert without["parent_block_hash"] == int.from_bytes(b"k" * 8, "big")
        sub.close(linger=0)
