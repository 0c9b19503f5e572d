"""`bench net`'s multi-client rows: 8 client processes getting 2 MiB values at once.

- `get_mc8/2MiB` against `raw_socket_mp`: the aggregate GB/s of 8 client processes doing
  `get_into` against a daemon with every worker (`--workers 0`: one per core), next to the same
  8 processes against a raw socket server that forks one process per connection (the floor of
  a multi-process Python server on this machine).
- `workers_scaling/2MiB`: the same 8 clients against every worker vs one worker. On a machine
  with few cores the clients share them with the daemon, so this shows that the daemon *can*
  spread its work, not the ceiling of a storage node.

Each client process connects, then all start together at a barrier, each round; a round's
rate is the bytes all clients moved divided by the time from the barrier to the last finish.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvoffload.bench.common import Row, cpu_seconds, daemon
from kvoffload.bench.micro.raw_socket import RawClient, raw_connection
from kvoffload.client_sdk import Client

__all__ = ["mc_rows"]

CLIENTS = 8
SIZE = 2 << 20
KEYS = 32  # 64 MiB of distinct values, DRAM hits
GETS = 24  # per client per round: 8 × 24 × 2 MiB = 384 MiB a round


def _kv_client(url: str, rounds: int, barrier: Any, done: Any) -> None:
    keys = [i.to_bytes(16, "big") for i in range(KEYS)]
    out = np.empty(SIZE, dtype=np.uint8)
    with Client.connect(url) as client:
        client.get_into(keys[0], out)  # connected and warm before the clock starts
        for r in range(rounds):
            barrier.wait()
            for i in range(GETS):
                if client.get_into(keys[(i + r * 7 + os.getpid()) % KEYS], out) is None:
                    raise RuntimeError("a get missed: the bench's keys were evicted")
            done.put(time.perf_counter())


def _raw_client(port: int, rounds: int, barrier: Any, done: Any) -> None:
    raw = RawClient(port, SIZE)
    try:
        raw.get(SIZE)
        for _ in range(rounds):
            barrier.wait()
            for _ in range(GETS):
                raw.get(SIZE)
            done.put(time.perf_counter())
    finally:
        raw.close()


def _aggregate(target: Any, arg: object, rounds: int) -> float:
    """Median over rounds of the GB/s that CLIENTS processes running `target` moved."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(CLIENTS + 1)
    done = ctx.Queue()
    procs = [ctx.Process(target=target, args=(arg, rounds, barrier, done)) for _ in range(CLIENTS)]
    for p in procs:
        p.start()
    rates: list[float] = []
    try:
        for _ in range(rounds):
            barrier.wait(timeout=120)
            start = time.perf_counter()
            ends = [done.get(timeout=300) for _ in range(CLIENTS)]
            rates.append(CLIENTS * GETS * SIZE / (max(ends) - start) / 1e9)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in procs):
        raise RuntimeError("a bench client process failed (see its traceback above)")
    return float(statistics.median(rates))


def _forking_server(listener: socket.socket) -> None:
    """One process per connection, as a multi-process server at its simplest."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            with contextlib.suppress(OSError):
                raw_connection(conn, SIZE)
            os._exit(0)
        conn.close()


@contextlib.contextmanager
def _raw_mp() -> Iterator[int]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    server = multiprocessing.get_context("fork").Process(
        target=_forking_server, args=(listener,), daemon=True
    )
    server.start()
    port = listener.getsockname()[1]
    listener.close()
    try:
        yield port
    finally:
        server.terminate()
        server.join(10)


def _fill(url: str) -> None:
    value = np.frombuffer(os.urandom(SIZE), dtype=np.uint8)
    with Client.connect(url) as client:
        for i in range(KEYS):
            client.put(i.to_bytes(16, "big"), value)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rpartition(")")[2].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def mc_rows(rounds: int) -> list[Row]:
    cores = len(os.sched_getaffinity(0))
    rates: dict[int, float] = {}
    spread = ""
    for workers in (cores, 1) if cores > 1 else (1,):
        with tempfile.TemporaryDirectory() as tmp, daemon("512MiB", tmp, workers) as (url, pid):
            _fill(url)
            procs = [pid, *_children(pid)] if workers > 1 else [pid]
            before = {p: cpu_seconds(p) for p in procs}
            rates[workers] = _aggregate(_kv_client, url, rounds)
            if workers > 1:
                used = [cpu_seconds(p) - before[p] for p in procs]
                spread = "; daemon CPU s per process during the rounds (supervisor first): " + (
                    ", ".join(f"{u:.2f}" for u in used)
                )
    with _raw_mp() as port:
        raw = _aggregate(_raw_client, port, rounds)
    note = (
        f"{CLIENTS} client processes × {GETS} get_into of 2 MiB per round, all DRAM hits, "
        f"daemon with {cores} worker(s) (one per core); {cores} cores shared by clients and "
        "server"
    )
    rows = [Row("get_mc8/2MiB", rates[cores], "GB/s", "raw_socket_mp", raw, note=note)]
    rows.append(
        Row(
            "workers_scaling/2MiB",
            rates[cores],
            "GB/s",
            "workers_1",
            rates.get(1),
            note=f"get_mc8 with {cores} workers vs 1; on {cores} cores the 8 clients compete "
            f"with the daemon for the same cores{spread}",
        )
    )
    return rows
