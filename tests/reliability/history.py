"""Operation histories of concurrent clients and a per-key register checker for them.

Every key is a register. Each operation records who ran it, when it was invoked and when it
completed (one system-wide monotonic clock), and what it wrote or read. Values identify
themselves (key, version id, CRC32C of the body), so a read maps to exactly one write or is
flagged as never put / corrupt.

The rules (a cache may always miss, so a miss is never a violation):

* stale: a read R returns version w although an acknowledged write w2 of the same key (a put
  or a delete) started after w completed and completed before R started ("resurrected" when
  w2 is a delete: a deleted value came back);
* future: R returns a version whose write started after R completed;
* never-put / corrupt: R returns bytes no write of that key produced.

A crash (the store is SIGKILLed at time T and serves again from a later time; every operation
invoked before T is over by then) keeps, per key, any version that no acknowledged *durable*
write (or earlier recovery) strictly follows; fast puts and deletes may be lost. The checker
models it as a recovery at T that rewrites the versions it keeps (so reads after T may return
them) and makes every other version of the key stale for good. A write that failed may or may
not have taken effect before the next crash (or ever, without one), unless the store answered
that it changed nothing.

Durability is also counted: a key whose last write before a crash was an acknowledged durable
put that no other write overlapped must read back exactly that put on its first read after the
restart; a miss is "durable missing", an older version "durable lost" (also a stale violation).
"""

from __future__ import annotations

import bisect
import json
import math
import struct
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import crc32c

# ---------------------------------------------------------------------------- values

MAGIC = b"KVSK"
_HEADER = struct.Struct("<4s16sQII")  # magic, key, version id, length, CRC32C of the body
HEADER_BYTES = _HEADER.size


def make_value(key: bytes, version: int, size: int) -> bytes:
    """`size` bytes that name `key` and `version`; the body differs for every version."""
    body_len = max(0, size - HEADER_BYTES)
    word = struct.pack("<Q", version ^ 0x9E3779B97F4A7C15)
    body = (word * (body_len // 8 + 1))[:body_len]
    return _HEADER.pack(MAGIC, key, version, HEADER_BYTES + body_len, crc32c.crc32c(body)) + body


def parse_value(key: bytes, data: bytes) -> int | str:
    """The version id `data` carries, or a string saying why it is not a value of `key`."""
    if len(data) < HEADER_BYTES:
        return f"corrupt: {len(data)} bytes, shorter than a header"
    magic, owner, version, length, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        return f"corrupt: bad magic {magic!r}"
    if owner != key:
        return f"corrupt: value of key {owner.hex()}"
    if length != len(data):
        return f"corrupt: {len(data)} bytes, header says {length}"
    if crc32c.crc32c(memoryview(data)[HEADER_BYTES:]) != crc:
        return "corrupt: body CRC mismatch"
    return int(version)


# ---------------------------------------------------------------------------- history

PUT, DPUT, DELETE, GET, CRASH = "put", "dput", "del", "get", "crash"
WRITES = (PUT, DPUT, DELETE)


@dataclass(frozen=True, slots=True)
class Op:
    """One operation. `value`: the version a put wrote, or the version a get returned (None:
    a miss). `ok`: acknowledged / answered; else `error` names the exception. `bad`: why a
    get's bytes are not a value of `key` (then `value` is None)."""

    client: int
    kind: str
    key: int
    value: int | None
    invoke: float
    complete: float
    ok: bool = True
    error: str = ""
    bad: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(line: str) -> Op:
        return Op(**json.loads(line))


@dataclass(frozen=True)
class Violation:
    kind: str  # stale, resurrected, future, never-put, corrupt
    read: Op
    detail: str


@dataclass
class Report:
    ops: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    writes_acked: int = 0
    durable_acked: int = 0
    crashes: int = 0
    # Keys whose last write before a crash was an acknowledged durable put nothing overlapped,
    # and what their first read after the restart returned.
    durable_final: int = 0
    durable_survived: int = 0
    durable_missing: int = 0
    durable_lost: int = 0
    durable_unread: int = 0  # no read came before the key's next write
    errors: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)

    def summary(self) -> str:
        kinds = Counter(v.kind for v in self.violations)
        return (
            f"ops {self.ops}, reads {self.reads}, hits {self.hits}, misses {self.misses}, "
            f"acked writes {self.writes_acked}, acked durable {self.durable_acked}, "
            f"crashes {self.crashes}, durable final/survived/missing/lost/unread "
            f"{self.durable_final}/{self.durable_survived}/{self.durable_missing}/"
            f"{self.durable_lost}/{self.durable_unread}, violations {len(self.violations)} "
            f"{dict(kinds)}, errors {dict(self.errors)}"
        )


@dataclass
class _Version:
    """One version of a key: when its write ran (a failed write may have taken effect until
    the next crash), and the recoveries that kept it."""

    write: Op
    end: float  # the write's complete time, or for a failed one the next crash (or never)
    recovered: list[float] = field(default_factory=list)  # crash times, ascending

    def justifies_until(self, read: Op) -> float | None:
        """The latest completion among this version's events that began before `read` ended,
        or None when every one of them began after it."""
        latest = self.end if self.write.invoke < read.complete else None
        i = bisect.bisect_left(self.recovered, read.complete)
        if i:
            kept = self.recovered[i - 1]
            latest = kept if latest is None else max(latest, kept)
        return latest


class _Latest:
    """The write with the greatest invoke among the acknowledged writes completed before t."""

    def __init__(self, writes: Iterable[Op]) -> None:
        ordered = sorted(writes, key=lambda w: w.complete)
        self._completes = [w.complete for w in ordered]
        self._best: list[Op] = []
        for w in ordered:
            self._best.append(
                w if not self._best or w.invoke > self._best[-1].invoke else self._best[-1]
            )

    def before(self, t: float) -> Op | None:
        i = bisect.bisect_left(self._completes, t)
        return self._best[i - 1] if i else None


def check(history: Sequence[Op], *, no_effect: Collection[str] = ()) -> Report:
    """Check a whole history (any order) and count. A crash is an op of kind CRASH from the
    SIGKILL (invoke) to the moment the restarted store serves again (complete). A write that
    failed with an error named in `no_effect` (one the store answers, such as CapacityError)
    changed nothing; any other failed write may have taken effect."""
    report = Report()
    crashes = sorted((op.invoke, op.complete) for op in history if op.kind == CRASH)
    report.crashes = len(crashes)
    by_key: dict[int, list[Op]] = defaultdict(list)
    for op in history:
        if op.kind == CRASH:
            continue
        report.ops += 1
        by_key[op.key].append(op)
        if not op.ok:
            report.errors[f"{op.kind}:{op.error}"] += 1
        elif op.kind == GET:
            report.reads += 1
            report.hits += op.value is not None or bool(op.bad)
            report.misses += op.value is None and not op.bad
        else:
            report.writes_acked += 1
            report.durable_acked += op.kind == DPUT
    for key, ops in by_key.items():
        _check_key(key, sorted(ops, key=lambda op: op.invoke), crashes, no_effect, report)
    return report


def _effective_end(
    op: Op, crashes: Sequence[tuple[float, float]], no_effect: Collection[str]
) -> float | None:
    """When a write's effect may have happened by: its completion once acknowledged; for a
    failed one the next crash, or never without one; None if it cannot have happened (the
    store said so, or was down throughout)."""
    if op.ok:
        return op.complete
    if op.error in no_effect:
        return None
    i = bisect.bisect_right(crashes, (op.invoke, math.inf))
    if i and op.invoke < crashes[i - 1][1]:
        return None  # invoked while the store was down (between SIGKILL and restart)
    return crashes[i][0] if i < len(crashes) else math.inf


def _check_key(
    key: int,
    ops: list[Op],
    crashes: Sequence[tuple[float, float]],
    no_effect: Collection[str],
    report: Report,
) -> None:
    versions: dict[int, _Version] = {}
    writes: list[tuple[Op, float]] = []  # (write, effective end) by invoke, every status
    for op in ops:
        if op.kind not in WRITES:
            continue
        end = _effective_end(op, crashes, no_effect)
        if end is None:
            continue
        writes.append((op, end))
        if op.kind != DELETE:
            assert op.value is not None
            versions[op.value] = _Version(op, end)
    latest = _Latest(w for w, _ in writes if w.ok)
    durable_latest = _Latest(w for w, _ in writes if w.ok and w.kind == DPUT)
    reads = [op for op in ops if op.kind == GET and op.ok]
    write_invokes = [w.invoke for w, _ in writes]
    read_invokes = [r.invoke for r in reads]
    # Recoveries: at each crash, every version no durable write (or earlier recovery)
    # strictly follows survives as a candidate; the rest can never be read again.
    candidates = list(versions.values())
    previous = -math.inf
    for t, _ in crashes:
        durable = durable_latest.before(t)
        floor = max(previous, durable.invoke if durable else -math.inf)
        kept = []
        for v in candidates:
            if v.write.invoke >= t:
                kept.append(v)  # written after this crash: judged at a later one
                continue
            last = max([v.end, *v.recovered]) if v.end < t else t
            if last >= floor:
                v.recovered.append(t)
                kept.append(v)
        candidates = kept
        _count_durable(writes, write_invokes, reads, read_invokes, previous, t, report)
        previous = t
    for read in reads:
        if read.bad:
            report.violations.append(Violation("corrupt", read, read.bad))
            continue
        if read.value is None:
            continue
        version = versions.get(read.value)
        if version is None:
            report.violations.append(
                Violation("never-put", read, f"key {key}: version {read.value} never written")
            )
            continue
        until = version.justifies_until(read)
        if until is None:
            report.violations.append(
                Violation("future", read, f"key {key}: its write began after the read ended")
            )
            continue
        newer = latest.before(read.invoke)
        if newer is not None and newer.invoke > until:
            report.violations.append(
                Violation(
                    "resurrected" if newer.kind == DELETE else "stale",
                    read,
                    f"key {key}: read version {read.value} ({version.write.kind} "
                    f"{version.write.invoke:.6f}-{version.end:.6f}) at {read.invoke:.6f}, but "
                    f"{newer.kind} {newer.value} ran {newer.invoke:.6f}-{newer.complete:.6f}",
                )
            )


def _count_durable(
    writes: list[tuple[Op, float]],
    invokes: list[float],
    reads: list[Op],
    read_invokes: list[float],
    previous: float,
    crash: float,
    report: Report,
) -> None:
    """The first read after `crash` of a key whose last write before it was an acknowledged
    durable put (made since the previous crash) that no other write overlapped."""
    lo, hi = bisect.bisect_right(invokes, previous), bisect.bisect_left(invokes, crash)
    if lo == hi:
        return
    last = writes[hi - 1][0]
    if not (last.ok and last.kind == DPUT):
        return
    if any(end >= last.invoke for _, end in writes[lo : hi - 1]):
        return  # another write overlapped it
    report.durable_final += 1
    next_write = writes[hi][0].invoke if hi < len(writes) else math.inf
    i = bisect.bisect_right(read_invokes, crash)
    first = reads[i] if i < len(reads) else None
    if first is None or first.complete >= next_write:
        report.durable_unread += 1
    elif first.value == last.value:
        report.durable_survived += 1
    elif first.value is None and not first.bad:
        report.durable_missing += 1
    else:
        report.durable_lost += 1
