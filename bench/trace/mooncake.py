"""The Mooncake FAST'25 trace format.

Mooncake's traces (`kvcache-ai/Mooncake`, `FAST25-release/traces/`, Apache-2.0) hold one
request a line: ``timestamp`` (ms from the start), ``input_length``, ``output_length`` and
``hash_ids``, one remapped prefix hash per 512-token block (equal ids: the same prefix up to
and including that block). No token ids: each id becomes one block key through
`engine_hashes`, as a serving engine's own block hashes do, so chains need no tokens.
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvoffload.bench.trace.workload import Request, Trace, read_jsonl
from kvoffload.errors import ConfigError

__all__ = [
    "BLOCK_TOKENS",
    "FIELDS",
    "is_mooncake",
    "read_mooncake",
    "read_trace",
    "window",
]

BLOCK_TOKENS = 512  # tokens per hash id in every Mooncake trace
FIELDS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})


def _lines(path: str | Path) -> list[str]:
    try:
        if str(path).endswith(".xz"):
            with lzma.open(path, "rt") as fh:
                return fh.readlines()
        with open(path) as fh:
            return fh.readlines()
    except (OSError, lzma.LZMAError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from None


def is_mooncake(lines: Sequence[str]) -> bool:
    """Whether the first record has Mooncake's fields (and no others)."""
    for text in lines:
        if text.strip():
            try:
                record = json.loads(text)
            except ValueError:
                return False
            return isinstance(record, dict) and set(record) == FIELDS
    return False


def _count(record: dict[str, object], name: str, line: int) -> int:
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"trace line {line}: {name} must be a non-negative integer, got {value!r}"
        )
    return value


def read_mooncake(lines: Sequence[str], source: str) -> Trace:
    """Requests of a Mooncake trace, in its order (arrival in seconds).

    Raises:
        ConfigError: a line is not a Mooncake record (the message names it), or none is there.
    """
    requests: list[Request] = []
    empty = np.empty(0, dtype=np.uint32)
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"trace line {number}: not JSON ({exc})") from None
        if not isinstance(record, dict) or set(record) != FIELDS:
            raise ConfigError(
                f"trace line {number}: a Mooncake record has exactly {sorted(FIELDS)}"
            )
        ids = record["hash_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in ids
        ):
            raise ConfigError(f"trace line {number}: hash_ids must be non-negative integers")
        length = _count(record, "input_length", number)
        if len(ids) != -(-length // BLOCK_TOKENS):
            raise ConfigError(
                f"trace line {number}: {len(ids)} hash_ids for {length} input tokens "
                f"(one per {BLOCK_TOKENS}-token block expected)"
            )
        requests.append(
            Request(
                conversation=f"r{number}",
                turn=0,
                arrival=_count(record, "timestamp", number) / 1e3,
                tokens=empty,
                output_tokens=_count(record, "output_length", number),
                kind="mooncake",
                block_ids=tuple(ids),
                length=length,
            )
        )
    if not requests:
        raise ConfigError(f"trace {source} holds no requests")
    return Trace(requests, source, {"format": "mooncake"}, block_tokens=BLOCK_TOKENS)


def read_trace(path: str | Path, *, seed: int = 0) -> Trace:
    """A trace file in either format: Mooncake's (detected from its fields; `.xz` allowed) or
    the bench's own JSONL (`read_jsonl`)."""
    lines = _lines(path)
    if is_mooncake(lines):
        return read_mooncake(lines, str(path))
    return read_jsonl(path, seed=seed)


def window(trace: Trace, start_s: float, end_s: float) -> Trace:
    """The requests arriving in [start_s, end_s), times kept.

    Raises:
        ConfigError: the window is empty or holds no request.
    """
    if not start_s < end_s:
        raise ConfigError(f"a time window needs start < end, got {start_s}:{end_s}")
    kept = [r for r in trace.requests if start_s <= r.arrival < end_s]
    if not kept:
        raise ConfigError(f"no request of {trace.source} arrives in [{start_s}, {end_s}) s")
    shape = {**trace.shape, "window_s": [start_s, end_s]}
    return Trace(kept, trace.source, shape, block_tokens=trace.block_tokens)
