"""A KV-aware router's index, as NVIDIA Dynamo's router builds it from KV events, for the tests.

Dynamo (`lib/kv-router`, ai-dynamo/dynamo) never trusts a publisher's block hashes for
matching: it hashes each `BlockStored`'s token ids itself (XXH3-64 of the ids as little-endian
u32, seed 1337: the block's *local* hash) and files the block under its parent, named by the
publisher's parent hash; a request's tokens are hashed the same way and walked from the root.
Sequence hashes chain as ``seq_0 = local_0``, ``seq_i = XXH3-64(le_u64(seq_{i-1}) ‖
le_u64(local_i), seed 1337)``. A LoRA name changes the seed (``1337 + XXH3-64(name)``, wrapping,
in the releases that mix it into the seed). Written from that description; no Dynamo code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

SEED = 1337
_U64 = (1 << 64) - 1


def seed_for(lora_name: str | None) -> int:
    if not lora_name:
        return SEED
    return (SEED + xxhash.xxh3_64_intdigest(lora_name.encode())) & _U64


def local_hash(tokens: Sequence[int] | np.ndarray, lora_name: str | None = None) -> int:
    data = np.asarray(tokens, dtype="<u4").tobytes()
    return xxhash.xxh3_64_intdigest(data, seed=seed_for(lora_name))


def local_hashes(tokens: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Each full block's local hash (a partial tail block has none)."""
    ids = np.asarray(tokens)
    full = len(ids) // block_size
    return [local_hash(ids[i * block_size : (i + 1) * block_size]) for i in range(full)]


def sequence_hashes(locals_: Sequence[int]) -> list[int]:
    out: list[int] = []
    for h in locals_:
        if not out:
            out.append(h)
            continue
        data = out[-1].to_bytes(8, "little") + h.to_bytes(8, "little")
        out.append(xxhash.xxh3_64_intdigest(data, seed=SEED))
    return out


@dataclass
class _Node:
    local: int
    parent: int | None
    media: set[str] = field(default_factory=set)


class DynamoIndex:
    """Blocks by the publisher's hash; children by (parent's publisher hash, local hash)."""

    def __init__(self) -> None:
        self.nodes: dict[int, _Node] = {}
        self.children: dict[int | None, dict[int, int]] = {}
        self.dropped = 0  # stored blocks whose parent the index did not know (Dynamo drops them)

    def apply(self, events: Iterable[dict[str, object]]) -> None:
        for event in events:
            if event["type"] == "BlockStored":
                self._stored(event)
            elif event["type"] == "BlockRemoved":
                self._removed(event)
            elif event["type"] == "AllBlocksCleared":
                self.nodes.clear()
                self.children.clear()

    def _stored(self, event: dict[str, object]) -> None:
        hashes = event["block_hashes"]
        tokens = event["token_ids"]
        size = event["block_size"]
        parent = event["parent_block_hash"]
        assert isinstance(hashes, list) and isinstance(tokens, list) and isinstance(size, int)
        assert size > 0 and len(tokens) == size * len(hashes), "events must carry token ids"
        if parent is not None and parent not in self.nodes:
            self.dropped += 1
            return
        lora = event.get("lora_name")
        for i, h in enumerate(hashes):
            local = local_hash(
                tokens[i * size : (i + 1) * size], lora if isinstance(lora, str) else None
            )
            node = self.nodes.get(h)
            if node is None or node.local != local:
                node = self.nodes[h] = _Node(local, parent if isinstance(parent, int) else None)
            node.media.add(str(event["medium"]))
            self.children.setdefault(node.parent, {})[local] = h
            parent = h

    def _removed(self, event: dict[str, object]) -> None:
        hashes = event["block_hashes"]
        assert isinstance(hashes, list)
        for h in hashes:
            node = self.nodes.get(h)
            if node is None:
                continue
            node.media.discard(str(event["medium"]))
            if not node.media:
                del self.nodes[h]
                siblings = self.children.get(node.parent, {})
                if siblings.get(node.local) == h:
                    del siblings[node.local]

    def longest_prefix(self, tokens: Sequence[int] | np.ndarray, block_size: int) -> int:
        """How many leading blocks of `tokens` some tier holds, by the index."""
        parent: int | None = None
        found = 0
        for local in local_hashes(tokens, block_size):
            h = self.children.get(parent, {}).get(local)
            if h is None or h not in self.nodes:
                break
            found += 1
            parent = h
        return found
