"""Replay on a daemon with several workers (`--workers 2`): the node's replay endpoint answers
with every shard's blocks, parents first across shards, numbered so that the live stream goes
on after the answer; a router index built from it answers "longest stored prefix" exactly as
`lookup` does, before and after a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from dynamo_index import DynamoIndex, local_hashes, sequence_hashes

from kvoffload.client_sdk import BlockMeta, Client
from kvoffload.wire.shards import shard_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

BLOCK_TOKENS = 16
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENV = {"KVOFFLOAD_EVENTS__REPLAY_ENDPOINT": "tcp://127.0.0.1:*"}


def _start(start_daemon: Any, data: Path) -> tuple[Any, str]:
    daemon = start_daemon("--workers", "2", "--events", "tcp://127.0.0.1:*", "--dram", "16MiB",
                          "--ssd", "32MiB", "--data-dir", str(data), env=ENV)  # fmt: skip
    (replay,) = [line.rsplit(" ", 1)[1] for line in daemon.lines if "events replay on" in line]
    return daemon, replay


def _replay(endpoint: str, topic: bytes = b"") -> tuple[list[dict[str, Any]], set[int]]:
    """The events of one replay answer and the sequence numbers its batches carried."""
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(endpoint)
    req.send_multipart([b"", (0).to_bytes(8, "big"), topic] if topic else [b"", bytes(8)])
    events: list[dict[str, Any]] = []
    numbers: set[int] = set()
    while True:
        assert req.poll(60_000), "no replay answer"
        _, seq, payload = req.recv_multipart()
        if seq == END_SEQ:
            break
        events += msgpack.unpackb(payload)[1]
        numbers.add(int.from_bytes(seq, "big"))
    req.close(linger=0)
    return events, numbers


def _chains(count: int, blocks: int) -> list[tuple[list[bytes], np.ndarray]]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(count):
        tokens = rng.integers(0, 50_000, blocks * BLOCK_TOKENS)
        out.append(([rng.bytes(16) for _ in range(blocks)], tokens))
    return out


def test_a_two_worker_node_answers_replay_with_every_shard(
    start_daemon: Any, tmp_path: Path
) -> None:
    chains = _chains(6, 8)
    keys_all = [k for keys, _ in chains for k in keys]
    assert {shard_of(k, 2) for k in keys_all} == {0, 1}
    daemon, replay = _start(start_daemon, tmp_path / "data")
    with Client.connect(daemon.url()) as client:
        for n, (keys, tokens) in enumerate(chains):
            seqs = sequence_hashes(local_hashes(tokens, BLOCK_TOKENS))
            blocks = tokens.reshape(-1, BLOCK_TOKENS).tolist()
            keep = len(keys) - n % 3  # some chains stored only in part
            metas = [
                BlockMeta(tuple(blocks[i]), seqs[i], seqs[i - 1] if i else None)
                for i in range(keep)
            ]
            client.put_many([(k, b"v" * 1000) for k in keys[:keep]],
                            parents=[keys[i - 1] if i else None for i in range(keep)],
                            metas=metas)  # fmt: skip
        events, numbers = _replay(replay)
        assert len(events) == sum(len(k) - n % 3 for n, (k, _) in enumerate(chains))
        index = DynamoIndex()
        index.apply(events)  # drops a block whose parent came later: none may
        for keys, tokens in chains:
            assert index.longest_prefix(tokens.tolist(), BLOCK_TOKENS) == client.lookup(keys)
        # The answer carries the node's current number: the next live batch follows it.
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(daemon.events)
        live: list[int] = []
        for i in range(200):
            client.put(bytes([i % 256]) * 16, b"x", meta=BlockMeta((1, 2, 3)))
            if sub.poll(100):
                live.append(int.from_bytes(sub.recv_multipart()[1], "big"))
                break
        assert live and live[0] > max(numbers)
        sub.close(linger=0)
    daemon.stop()

    # Restarted: each worker announces its shard; a replay gets the same blocks back.
    daemon, replay = _start(start_daemon, tmp_path / "data")
    with Client.connect(daemon.url()) as client:
        fresh = DynamoIndex()
        again, _ = _replay(replay)
        fresh.apply(again)
        assert again and {e["medium"] for e in again} == {"STORAGE"}  # DRAM was written out
        for keys, tokens in chains:
            assert fresh.longest_prefix(tokens.tolist(), BLOCK_TOKENS) == client.lookup(keys)
        assert sum(client.lookup(keys) for keys, _ in chains) > 0
        nothing, _ = _replay(replay, b"no-such-topic")
        assert nothing == []
