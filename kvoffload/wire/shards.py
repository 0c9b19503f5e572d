"""Which shard of a multi-worker daemon holds a key, and how shards' stats add up.

Shared by the SDK (which routes every key straight to its shard) and the daemon (whose
supervisor sums its workers' stats for `/metrics`), so both sides agree by construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import crc32c

__all__ = ["FLAGS", "merge_stats", "shard_of"]

# Numbers that are yes/no flags of the machine, not counts: every worker sees the same kernel,
# so the node's flag is any worker's (max), not the number of workers that saw it.
FLAGS = frozenset({"io_clone_unsupported", "clone_unsupported"})


def shard_of(key: bytes, count: int) -> int:
    """The shard of `key` among `count`: CRC32C (in C, ~0.1 µs for a 16-byte key) modulo the
    count. Keys are the client's (tenants add their prefix inside the shard), so routing needs
    no knowledge of tenants. A store's shard count is fixed when it is created."""
    return crc32c.crc32c(key) % count if count > 1 else 0


def merge_stats(parts: Sequence[Mapping[str, object]]) -> dict[str, object]:
    """One node's stats from its shards': numbers add up (durations, named ``*_s``, take the
    longest: the shards ran side by side; flags, named in `FLAGS`, are set if any shard's is),
    maps of numbers add per key, tiers add per tier name; other values (names, versions) are
    the first shard's."""
    merged: dict[str, object] = {}
    for part in parts:
        for name, value in part.items():
            merged[name] = _add(merged[name], value, name) if name in merged else _copy(value)
    return merged


def _copy(value: object) -> object:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def _add(into: object, value: object, name: str = "") -> object:
    if _number(into) and _number(value):
        if name.endswith("_s") or name in FLAGS:
            return max(into, value)  # type: ignore[call-overload]
        return into + value  # type: ignore[operator]
    if isinstance(into, dict) and isinstance(value, Mapping):
        for k, v in value.items():
            into[k] = _add(into[k], v, str(k)) if k in into else _copy(v)
        return into
    if isinstance(into, list) and isinstance(value, (list, tuple)) and _named(into, value):
        by_name = {str(t["name"]): t for t in into}
        for tier in value:
            name = str(tier["name"])
            if name in by_name:
                _add(by_name[name], tier)
            else:
                into.append(_copy(tier))
        return into
    return into


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _named(a: Sequence[object], b: Sequence[object]) -> bool:
    return all(isinstance(t, dict) and "name" in t for t in (*a, *b))
