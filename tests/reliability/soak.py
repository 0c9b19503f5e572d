"""The concurrent soak: worker processes of client threads hammer a daemon over kv:// with
durable and fast overwrites, deletes and gets of a small hot key set, recording a history
(`history.Op`) that `history.check` judges afterwards.

A worker process (``python soak.py worker ID THREADS SEED``) reads one command per line on
stdin: ``run URL SECONDS FILE`` runs its threads against URL for SECONDS, writes their history to
FILE as JSON lines and answers ``done``; end of input stops it. The test drives the workers with
`Workers` and owns the daemon (and its SIGKILLs).
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from history import DELETE, DPUT, GET, PUT, Op, make_value, parse_value

from kvoffload.client_sdk import Client
from kvoffload.errors import DeadlineExceededError, KVOffloadError, TransportError


@dataclass(frozen=True)
class Mix:
    keys: int = 32  # the hot key set every thread shares
    # Each thread also has a key of its own (keys + thread number) that it picks this often:
    # nobody else writes it, so its last write before a SIGKILL is often an acknowledged durable
    # put that nothing overlapped, which must then survive.
    own: float = 0.2
    min_size: int = 64 << 10
    max_size: int = (2 << 20) - (64 << 10)  # under the daemon's 2 MiB block limit (32 MiB DRAM)
    # Operation weights; the stale-read race needs a fast put followed by a durable one.
    get: float = 0.45
    put: float = 0.25
    dput: float = 0.25
    delete: float = 0.05


MIX = Mix()


def key_bytes(k: int) -> bytes:
    return b"soak" + k.to_bytes(12, "little")


def _size(rng: random.Random) -> int:
    """Log-uniform: as many values between 64 and 128 KiB as between 1 and 2 MiB."""
    lo, hi = math.log(MIX.min_size), math.log(MIX.max_size)
    return int(math.exp(rng.uniform(lo, hi)))


def _one(client: Client, rng: random.Random, cid: int, own_key: int, version: int) -> Op:
    k = own_key if rng.random() < MIX.own else rng.randrange(MIX.keys)
    key = key_bytes(k)
    weights = (MIX.get, MIX.put, MIX.dput, MIX.delete)
    kind = rng.choices((GET, PUT, DPUT, DELETE), weights)[0]
    value: int | None = version if kind in (PUT, DPUT) else None
    data = make_value(key, version, _size(rng)) if value is not None else b""
    bad = ""
    invoke = time.monotonic()
    try:
        if kind == GET:
            got = client.get(key)
            if got is not None:
                parsed = parse_value(key, got)
                value, bad = (parsed, "") if isinstance(parsed, int) else (None, parsed)
        elif kind == DELETE:
            client.delete(key)
        else:
            client.put(key, data, durable=kind == DPUT)
    except KVOffloadError as exc:
        return Op(cid, kind, k, value, invoke, time.monotonic(), False, type(exc).__name__)
    except Exception as exc:  # not a documented error: recorded, and the test fails on it
        return Op(cid, kind, k, value, invoke, time.monotonic(), False, f"!{type(exc).__name__}")
    return Op(cid, kind, k, value, invoke, time.monotonic(), bad=bad)


def _thread(url: str, seconds: float, cid: int, own_key: int, seed: int, out: list[Op]) -> None:
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    seq = 0
    try:
        with Client.connect(url) as client:
            while time.monotonic() < deadline:
                seq += 1
                op = _one(client, rng, cid, own_key, (seed << 24) | seq)
                out.append(op)
                if op.error in (TransportError.__name__, DeadlineExceededError.__name__):
                    time.sleep(0.1)  # the daemon is down: do not spin until it is back
    except Exception as exc:  # opening or closing the client: recorded, the test fails on it
        now = time.monotonic()
        out.append(Op(cid, "client", -1, None, now, now, False, f"!{type(exc).__name__}"))


def worker_main(wid: int, threads: int, seed: int) -> None:
    for rounds, line in enumerate(sys.stdin, 1):
        _, url, seconds, path = line.split()
        ops: list[list[Op]] = [[] for _ in range(threads)]
        pool = [
            threading.Thread(
                target=_thread,
                # A seed unique to (worker, thread, round) also makes version ids unique.
                args=(
                    url,
                    float(seconds),
                    wid * 1000 + t,
                    MIX.keys + wid * threads + t,
                    (seed + rounds) * 4096 + wid * 64 + t,
                ),
                kwargs={"out": ops[t]},
            )
            for t in range(threads)
        ]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        with open(path, "w") as fh:
            for thread_ops in ops:
                fh.writelines(op.to_json() + "\n" for op in thread_ops)
        print("done", flush=True)


class Workers:
    """`processes` worker processes of `threads` client threads each."""

    def __init__(self, tmp: Path, processes: int, threads: int, seed: int) -> None:
        self.tmp = tmp
        self.rounds = 0
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "worker", str(w), str(threads), str(seed)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for w in range(processes)
        ]

    def run(self, url: str, seconds: float, during: Callable[[], None] | None = None) -> list[Op]:
        """Run every thread for `seconds`; `during` runs meanwhile (e.g. a SIGKILL)."""
        self.rounds += 1
        paths = [self.tmp / f"history.{self.rounds}.{w}.jsonl" for w in range(len(self.procs))]
        for proc, path in zip(self.procs, paths, strict=True):
            assert proc.stdin is not None
            proc.stdin.write(f"run {url} {seconds} {path}\n")
            proc.stdin.flush()
        if during is not None:
            during()
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "done\n", f"worker {proc.pid} died (rc {proc.poll()})"
        ops = []
        for path in paths:
            ops += [Op.from_json(line) for line in path.read_text().splitlines()]
            path.unlink()
        return ops

    def close(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def read_all(url: str, keys: int, cid: int = -1) -> list[Op]:
    """One get of each of the first `keys` keys, one after another (the reads right after a
    restart)."""
    ops = []
    with Client.connect(url) as client:
        for k in range(keys):
            invoke = time.monotonic()
            got = client.get(key_bytes(k))
            complete = time.monotonic()
            value: int | str | None = None if got is None else parse_value(key_bytes(k), got)
            if isinstance(value, str):
                ops.append(Op(cid, GET, k, None, invoke, complete, bad=value))
            else:
                ops.append(Op(cid, GET, k, value, invoke, complete))
    return ops


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
