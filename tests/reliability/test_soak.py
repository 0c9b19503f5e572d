"""The concurrent soak and SIGKILL rounds under it, judged by the register checker.

A real `kvoffload serve` with a DRAM tier far smaller than the working set (so blocks are
demoted to the SSD tier all the time) serves 4 worker processes x 16 client threads doing
durable and fast overwrites, deletes and gets of 32 hot keys (and of one key of each thread's
own), values of 64 KiB - 1.94 MiB (the 32 MiB DRAM tier takes blocks up to 2 MiB). Every read
must be legal for a register (`history.check`), the daemon must log no traceback, and clients
see no errors but documented ones. Short form for CI (20 s soak, 6 SIGKILL rounds);
KVOFFLOAD_RELIABILITY=long runs 60 s and 100 rounds.
"""

from __future__ import annotations

import bisect
import math
import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from history import CRASH, Op, Report, check
from soak import MIX, Workers, read_all

from kvoffload.client_sdk import Client

LONG = os.environ.get("KVOFFLOAD_RELIABILITY") == "long"
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500 if LONG else 300)]
SOAK_SECONDS = 60.0 if LONG else 20.0
ROUNDS = 100 if LONG else 6
ROUND_SECONDS = 6.0  # of load; the SIGKILL comes after 30-80% of it
PROCESSES, THREADS = 4, 16
# The SSD holds every key's largest value many times over, so nothing durable is ever evicted
# from it to make room: a durable put that no later write touched must survive every crash.
FLAGS = ("--dram", "32MiB", "--ssd", "1GiB")
CONFIG = "[ssd]\nadmission_min_uses = 1\n"  # every block leaving DRAM is demoted to the SSD
KEYS = MIX.keys + PROCESSES * THREADS  # the hot keys and one of each thread's own
assert 4 * KEYS * MIX.max_size < 1 << 30
# What clients may see: a full DRAM tier refuses puts (CapacityError); a SIGKILLed daemon fails
# what was in flight and what is tried while it is down.
DOCUMENTED = {"put:CapacityError", "dput:CapacityError"}
REFUSED = {"CapacityError"}  # the daemon answered that the put changed nothing
DOWN = ("TransportError", "DeadlineExceededError")


# tests/conftest.py's daemon helper (not imported: a conftest.py of this folder would shadow it).
Daemon = Any
Start = Callable[..., Daemon]


def start(start_daemon: Start, data: Path) -> Daemon:
    return start_daemon("--data-dir", str(data), *FLAGS, config=CONFIG)


def demotions(daemon: Daemon) -> int:
    with Client.connect(daemon.url()) as client:
        tiers = client.stats().store["tiers"]
    assert isinstance(tiers, list)
    return int(tiers[0]["demotions"])


def sigkill(daemon: Daemon, after: float, killed: list[float]) -> None:
    time.sleep(after)
    killed.append(time.monotonic())
    # The whole process group at once: with several workers, none may serve past the crash.
    os.killpg(daemon.proc.pid, signal.SIGKILL)
    daemon.proc.wait()


def failed_while_up(history: list[Op]) -> Counter[str]:
    """Operations that failed as if the daemon were down although no SIGKILL came while they
    ran (nor before them in the same round)."""
    crashes = sorted((op.invoke, op.complete) for op in history if op.kind == CRASH)
    early: Counter[str] = Counter()
    for op in history:
        if op.error in DOWN:
            i = bisect.bisect_right(crashes, (op.complete, math.inf))
            if not i or op.invoke > crashes[i - 1][1]:
                early[f"{op.kind}:{op.error}"] += 1
    return early


def verdict(name: str, report: Report, stderr: str, allowed: set[str]) -> list[str]:
    """The summary line, printed, and what is wrong with the run."""
    tracebacks = stderr.count("Traceback")
    raised = Counter(re.findall(r"^(\w[\w.]*(?:Error|Exception)):", stderr, re.MULTILINE))
    print(f"{name}: {report.summary()}, daemon tracebacks {tracebacks} {dict(raised)}")
    wrong = [f"{v.kind}: {v.detail} ({v.read})" for v in report.violations[:10]]
    if tracebacks:
        first = stderr[stderr.index("Traceback") :][:3000]
        wrong.append(f"{tracebacks} daemon tracebacks, the first:\n{first}")
    unexpected = Counter({e: n for e, n in report.errors.items() if e not in allowed})
    if unexpected:
        wrong.append(f"undocumented client errors: {dict(unexpected)}")
    return wrong


def test_concurrent_soak_is_linearizable(tmp_path: Path, start_daemon: Start) -> None:
    """Every read legal for a register, no daemon traceback, only documented client errors."""
    daemon = start(start_daemon, tmp_path / "data")
    workers = Workers(tmp_path, PROCESSES, THREADS, seed=random.randrange(1 << 16))
    try:
        ops = workers.run(daemon.url(), SOAK_SECONDS)
        demoted = demotions(daemon)
    finally:
        workers.close()
        daemon.stop()
    report = check(ops, no_effect=REFUSED)
    wrong = verdict("soak", report, daemon.stderr(), DOCUMENTED)
    print(f"soak: {demoted} blocks demoted from DRAM to the SSD")
    assert not wrong, "\n".join(wrong)
    # The run exercised what it is meant to: hits, demotions, acknowledged durable overwrites.
    assert report.hits and report.misses and report.durable_acked > MIX.keys
    assert demoted > 0


def test_sigkill_rounds_under_load_keep_acknowledged_puts(
    tmp_path: Path, start_daemon: Start
) -> None:
    """SIGKILL the daemon at a random moment of each round of load, restart it on the same data
    directory and read every key: nothing older than allowed, ever; every acknowledged durable
    put that no later write touched reads back."""
    data = tmp_path / "data"
    rng = random.Random()
    daemon = start(start_daemon, data)
    logs: list[str] = []
    history: list[Op] = []
    workers = Workers(tmp_path, PROCESSES, THREADS, seed=rng.randrange(1 << 16))
    try:
        for _ in range(ROUNDS):
            killed: list[float] = []
            after = rng.uniform(0.3, 0.8) * ROUND_SECONDS
            history += workers.run(
                daemon.url(), ROUND_SECONDS, during=partial(sigkill, daemon, after, killed)
            )
            daemon.stop()
            logs.append(daemon.stderr())
            daemon = start(start_daemon, data)  # the same data directory
            history.append(Op(0, CRASH, -1, None, killed[0], time.monotonic()))
            history += read_all(daemon.url(), KEYS)
    finally:
        workers.close()
        daemon.stop()
        logs.append(daemon.stderr())
    report = check(history, no_effect=REFUSED)
    down = {f"{op}:{e}" for op in ("get", "put", "dput", "del") for e in DOWN}
    wrong = verdict("sigkill", report, "".join(logs), DOCUMENTED | down)
    early = failed_while_up(history)
    if early:
        wrong.append(f"errors while the daemon was up: {dict(early)}")
    if report.durable_lost or report.durable_missing:
        wrong.append(
            f"acknowledged durable puts nothing overwrote: {report.durable_lost} read back "
            f"older, {report.durable_missing} missing after the restart"
        )
    assert not wrong, "\n".join(wrong)
    assert report.crashes == ROUNDS and report.durable_final > 0, report.summary()
