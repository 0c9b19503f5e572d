"""The register checker of the soak, on hand-made histories: it must flag what is wrong."""

from __future__ import annotations

import random

import pytest
from history import (
    CRASH,
    DELETE,
    DPUT,
    GET,
    HEADER_BYTES,
    PUT,
    Op,
    check,
    make_value,
    parse_value,
)

KEY = bytes(range(16))


def w(version: int, start: float, end: float, *, kind: str = PUT, ok: bool = True) -> Op:
    return Op(1, kind, 0, version, start, end, ok, "" if ok else "TransportError")


def r(version: int | None, start: float, end: float, bad: str = "") -> Op:
    return Op(2, GET, 0, version, start, end, bad=bad)


def crash(kill: float, back: float) -> Op:
    return Op(0, CRASH, -1, None, kill, back)


def kinds(*ops: Op) -> list[str]:
    return [v.kind for v in check(ops).violations]


def test_values_name_their_key_and_version() -> None:
    for size in (0, HEADER_BYTES, 64 << 10, (64 << 10) + 3):
        data = make_value(KEY, 7, size)
        assert len(data) == max(size, HEADER_BYTES)
        assert parse_value(KEY, data) == 7
    good = make_value(KEY, 7, 4096)
    assert "of key" in str(parse_value(bytes(16), good))
    assert "header says" in str(parse_value(KEY, good[:-8]))
    assert "shorter" in str(parse_value(KEY, good[:8]))
    flipped = bytearray(good)
    flipped[1000] ^= 1
    assert "CRC" in str(parse_value(KEY, bytes(flipped)))
    assert make_value(KEY, 1, 4096) != make_value(KEY, 2, 4096)


def test_sequential_reads_of_the_latest_write_are_legal() -> None:
    assert kinds(w(1, 0, 1), r(1, 2, 3), w(2, 4, 5), r(2, 6, 7), r(None, 8, 9)) == []


def test_a_read_of_an_overwritten_version_is_stale() -> None:
    assert kinds(w(1, 0, 1), w(2, 2, 3), r(1, 4, 5)) == ["stale"]
    assert kinds(w(1, 0, 1), w(2, 2, 3, kind=DPUT), r(1, 4, 5)) == ["stale"]


@pytest.mark.parametrize(
    "ops",
    [
        # the overwrite had not completed when the read began
        (w(1, 0, 1), w(2, 2, 5), r(1, 3, 4)),
        (w(1, 0, 1), w(2, 2, 3), r(1, 2.5, 4)),
        # the two writes overlap: either may be the last
        (w(1, 0, 3), w(2, 1, 2), r(1, 4, 5)),
        (w(1, 0, 3), w(2, 1, 2), r(2, 4, 5)),
        # the read overlaps the write it returns
        (w(1, 0, 1), w(2, 2, 5), r(2, 1.5, 3)),
    ],
)
def test_overlapping_operations_are_legal(ops: tuple[Op, ...]) -> None:
    assert kinds(*ops) == []


def test_deletes_are_writes_of_nothing() -> None:
    gone = Op(1, DELETE, 0, None, 2, 3)
    assert kinds(w(1, 0, 1), gone, r(1, 4, 5)) == ["resurrected"]
    assert kinds(w(1, 0, 1), gone, r(None, 4, 5)) == []
    assert kinds(w(1, 0, 1), gone, w(2, 3.5, 6), r(2, 4, 5)) == []
    assert kinds(w(1, 0, 1), Op(1, DELETE, 0, None, 2, 5), r(1, 4, 6)) == []


def test_bytes_nobody_wrote_are_flagged() -> None:
    assert kinds(w(1, 0, 1), r(9, 2, 3)) == ["never-put"]
    assert kinds(w(1, 0, 1), r(None, 2, 3, bad="corrupt: body CRC mismatch")) == ["corrupt"]
    assert kinds(w(1, 5, 6), r(1, 0, 1)) == ["future"]


def test_a_failed_write_may_have_happened() -> None:
    assert kinds(w(1, 0, 1, ok=False), r(1, 10, 11)) == []
    # ... but it cannot make an older version stale
    assert kinds(w(1, 0, 1), w(2, 2, 3, ok=False), r(1, 4, 5)) == []


def test_a_write_the_store_refused_never_happened() -> None:
    refused = Op(1, PUT, 0, 2, 2, 3, False, "CapacityError")
    assert kinds(w(1, 0, 1), refused, r(2, 4, 5)) == []  # unless told otherwise
    report = check([w(1, 0, 1), refused, r(2, 4, 5)], no_effect={"CapacityError"})
    assert [v.kind for v in report.violations] == ["never-put"]
    # ... so it does not excuse a durable put that is missing after a crash.
    lost = [w(1, 0, 1, kind=DPUT), refused, crash(4, 5), r(None, 6, 7)]
    report = check(lost, no_effect={"CapacityError"})
    assert (report.durable_final, report.durable_missing) == (1, 1)
    report = check(lost)
    assert (report.durable_final, report.durable_missing) == (0, 0)


def test_a_crash_may_lose_fast_writes_but_not_durable_ones() -> None:
    d1, f2 = w(1, 0, 1, kind=DPUT), w(2, 2, 3)
    assert kinds(d1, f2, crash(4, 5), r(1, 6, 7)) == []
    assert kinds(d1, f2, crash(4, 5), r(2, 6, 7)) == []
    assert kinds(w(0, 0, 1), w(1, 2, 3, kind=DPUT), crash(4, 5), r(0, 6, 7)) == ["stale"]
    # Without the crash, losing the fast write is a stale read.
    assert kinds(d1, f2, r(1, 6, 7)) == ["stale"]


def test_after_recovery_the_register_rules_apply_again() -> None:
    d1, f2 = w(1, 0, 1, kind=DPUT), w(2, 2, 3)
    assert kinds(d1, f2, crash(4, 5), r(2, 6, 7), w(3, 8, 9), r(1, 10, 11)) == ["stale"]
    assert kinds(d1, f2, crash(4, 5), r(2, 6, 7), w(3, 8, 9), r(3, 10, 11)) == []
    # Two crashes in a row keep what the first kept ...
    assert kinds(d1, f2, crash(4, 5), crash(6, 7), r(2, 8, 9)) == []
    assert kinds(d1, f2, crash(4, 5), crash(6, 7), r(1, 8, 9)) == []
    # ... until a durable write in between supersedes it.
    d3 = w(3, 5.5, 5.8, kind=DPUT)
    assert kinds(d1, f2, crash(4, 5), d3, crash(6, 7), r(2, 8, 9)) == ["stale"]
    assert kinds(d1, f2, crash(4, 5), d3, crash(6, 7), r(3, 8, 9)) == []


def test_writes_cut_by_a_crash() -> None:
    d1 = w(1, 0, 1, kind=DPUT)
    lost = w(2, 2, 4.5, kind=DPUT, ok=False)  # in flight at the SIGKILL (4)
    assert kinds(d1, lost, crash(4, 5), r(2, 6, 7)) == []
    assert kinds(d1, lost, crash(4, 5), r(1, 6, 7)) == []
    # Acknowledged although its answer arrived after the SIGKILL: it counts.
    late = w(2, 2, 4.5, kind=DPUT)
    assert kinds(d1, late, crash(4, 5), r(1, 6, 7), w(3, 8, 9), r(1, 10, 11)) == ["stale"]
    # Invoked while the store was down: it never happened.
    down = w(2, 4.2, 4.3, ok=False)
    assert kinds(d1, down, crash(4, 5), r(2, 6, 7)) == ["never-put"]
    # In flight after the restart with no crash to bound it: it may land any time.
    assert kinds(d1, crash(4, 5), w(2, 6, 7, ok=False), w(3, 8, 9), r(2, 10, 11)) == []


def test_durable_puts_are_counted_through_crashes() -> None:
    d1 = w(1, 0, 1, kind=DPUT)
    report = check([d1, crash(2, 3), r(1, 4, 5)])
    assert (report.durable_final, report.durable_survived, report.violations) == (1, 1, [])
    report = check([d1, crash(2, 3), r(None, 4, 5)])
    assert (report.durable_missing, report.violations) == (1, [])
    report = check([w(0, -2, -1), d1, crash(2, 3), r(0, 4, 5)])
    assert report.durable_lost == 1 and [v.kind for v in report.violations] == ["stale"]
    # Overlapped by a fast put, a delete or a failed write: a miss is legal and not counted.
    for other in (w(2, 0.5, 0.7), Op(1, DELETE, 0, None, 0.5, 1.5), w(2, 0.5, 1.5, ok=False)):
        report = check([d1, other, crash(2, 3), r(None, 4, 5)])
        assert (report.durable_final, report.violations) == (0, [])
    # A first read that came after the key's next write says nothing.
    report = check([d1, crash(2, 3), w(2, 4, 5), r(None, 6, 7)])
    assert (report.durable_unread, report.durable_missing) == (1, 0)
    # A put from before the previous crash is not counted again.
    report = check([d1, crash(2, 3), r(1, 4, 5), crash(6, 7), r(1, 8, 9)])
    assert (report.durable_final, report.durable_survived) == (1, 1)


def _legal_history(rng: random.Random) -> list[Op]:
    """Ops on one key with random, overlapping intervals, each with a linearization point
    inside; a model store applies them in that order (keeping a durable copy and what a crash
    may bring back), so every read is legal by construction."""
    ops: list[Op] = []
    version = 0
    state: int | None = None  # the register
    durable: int | None = None  # what a crash keeps for sure ...
    since: set[int] = set()  # ... or one of these fast puts made after it
    start = 0.0
    for _ in range(rng.randint(1, 3)):  # epochs, a crash after each but the last
        points = sorted(rng.uniform(start + 1.5, start + 9) for _ in range(rng.randint(1, 25)))
        for p in points:
            invoke, complete = p - rng.uniform(0, 1), p + rng.uniform(0, 1)
            kind = rng.choice([PUT, DPUT, DELETE, GET, GET])
            if kind == GET:
                hit = state is not None and rng.random() < 0.8
                ops.append(Op(2, GET, 0, state if hit else None, invoke, complete))
                continue
            version += 1
            ok = rng.random() < 0.85
            if not ok:  # the client may give up before the store applies it
                complete = invoke + rng.uniform(0, 1)
            if ok or rng.random() < 0.5:  # a failed write may have been applied
                state = None if kind == DELETE else version
                if kind == DPUT:
                    durable, since = version, set()
                elif kind == PUT:
                    since.add(version)
            value = None if kind == DELETE else version
            ops.append(Op(1, kind, 0, value, invoke, complete, ok, "" if ok else "X"))
        start += 10
        ops.append(crash(start, start + 0.5))
        state = rng.choice([durable, *since, None])
        durable, since = state, set()
    return ops[:-1] if rng.random() < 0.5 else ops


@pytest.mark.parametrize("seed", range(20))
def test_legal_histories_pass(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        ops = _legal_history(rng)
        report = check(ops)
        assert report.violations == [], (report.violations, ops)


@pytest.mark.parametrize("seed", range(10))
def test_any_older_version_in_a_sequential_history_is_stale(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        ops, state, t = [], None, 0.0
        for version in range(1, 20):
            t += 1
            if rng.random() < 0.6:
                kind = rng.choice([PUT, DPUT, DELETE])
                ops.append(w(version, t, t + 0.5, kind=kind))
                state = None if kind == DELETE else version
            else:
                ops.append(r(state, t, t + 0.5))
        written = [op.value for op in ops if op.kind in (PUT, DPUT)]
        hits = [i for i, op in enumerate(ops) if op.kind == GET]
        if not hits:
            continue
        i = rng.choice(hits)
        older = [v for v in written if v is not None and v < ops[i].invoke and v != ops[i].value]
        if not older:
            continue
        ops[i] = r(rng.choice(older), ops[i].invoke, ops[i].complete)
        # Which one depends on the last write before the read: a delete, or a put.
        last = max((op for op in ops if op.kind != GET and op.complete < ops[i].invoke),
                   key=lambda op: op.invoke)  # fmt: skip
        assert kinds(*ops) == ["resurrected" if last.kind == DELETE else "stale"], ops
