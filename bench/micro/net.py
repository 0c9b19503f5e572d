"""`kvoffload bench net`: one client against `kvoffload serve` on loopback, next to a raw socket
loop, Redis and LMCache's lm:// server measured in the same run.

Cases: put and get of 64 KiB, 2 MiB and 8 MiB values, one request at a time and pipelined
(`put_many`/`get_many_into` batches, the same depth for every reference), plus the p50/p99 of a
1,000-key `lookup`. kvoffload's get is `get_into` a preallocated buffer (its zero-copy path,
CRC32C verification included); its put seals a header and CRC32C.

References:
- raw_socket: a Python server process that `recv_into`s a preallocated buffer and answers with
  1 byte (put) or sends a preallocated buffer (get); the client uses `sendmsg` and `recv_into`.
  This is the floor of what any Python protocol on this machine can do (`raw_socket.py`).
- redis: Debian's `redis-server` (persistence off) through redis-py with its hiredis parser (as
  a Redis user runs it; the note says when hiredis is missing), `SET`/`GET`, pipelines for the
  pipelined cases (`peers/redis_ref.py`). Skipped (row with a null reference) when either is
  not installed.

`daemon_cpu_us/get/64KiB`: the CPU time of the daemon process (all its threads, from
/proc/<pid>/stat) divided by the requests of a loop of `--cpu-requests` 64 KiB gets, next to
the raw socket server's CPU per 64 KiB get read the same way in the same run (goal ≤ 1.5× it);
`daemon_cpu_us/put/64KiB` the same for as many 64 KiB puts (overwrites of 64 keys).
- lmcache: LMCache's own `lm://` server (`lmcache.v1.server`), driven by `bench/peers/lmserver.py`
  under a Python that has `lmcache` (`--lmcache-python`, env KVOFFLOAD_LMCACHE_PYTHON, else
  `.venv-lmcache` as `.ci/engines.sh lmcache` builds it, else this one). Its
  protocol does not answer a PUT, so its put cases end with one round trip; they are pipelined
  by nature. Skipped (a null reference with the reason) when that Python has no `lmcache`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvoffload.bench.common import BenchResult, Row, cpu_seconds, daemon, peer_python, time_median
from kvoffload.bench.micro.net_mc import mc_rows
from kvoffload.bench.micro.net_nixl import nixl_rows
from kvoffload.bench.micro.raw_socket import RawClient, raw_reference
from kvoffload.bench.peers.redis_ref import redis_parser, redis_rates, redis_server
from kvoffload.client_sdk import Client

__all__ = ["HELP", "SIZES", "add_arguments", "run", "run_from_args"]

HELP = "native protocol vs a raw socket loop, Redis and LMCache on loopback"

SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20, "8MiB": 8 << 20}
DEPTH = 8  # requests in flight in the pipelined cases
LOOKUP_KEYS = 1000
LOOKUP_GOAL_MS = 0.3  # issue 29's goal for the p50 of a 1,000-key lookup


def _daemon_cpu_row(client: Client, pid: int, raw: RawClient, requests: int) -> Row:
    """Daemon CPU µs per 64 KiB get over `requests` gets of a few hot keys (DRAM hits), next
    to the raw socket server's CPU per 64 KiB get, read from /proc the same way in the same run
    (the goal of issue 29: at most 1.5× the raw server's)."""
    size = 64 << 10
    keys = [i.to_bytes(16, "big") for i in range(64)]
    value = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)
    for key in keys:
        client.put(key, value)
    for key in keys:
        client.get_into(key, out)  # warm: first-touch and connection set-up not counted
    t0, cpu0 = time.perf_counter(), cpu_seconds(pid)
    for i in range(requests):
        client.get_into(keys[i % len(keys)], out)
    cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - t0
    for key in keys:
        client.delete(key)
    raw_cpu = _raw_cpu_per_get(raw, size, requests)
    note = (
        f"{requests:,} gets in {wall:.2f} s ({wall / requests * 1e6:.0f} µs each, wall); CPU of "
        "every daemon thread / requests, clock-tick resolution; reference: the raw socket "
        "server's CPU / requests over as many 64 KiB gets; goal ≤ 1.5× it (ratio ≥ 0.67)"
    )
    return Row("daemon_cpu_us/get/64KiB", cpu / requests * 1e6, "us", "raw_socket", raw_cpu, note)


def _daemon_put_cpu_row(client: Client, pid: int, raw: RawClient, requests: int) -> Row:
    """Daemon CPU µs per 64 KiB put over `requests` puts that overwrite a few keys (DRAM only,
    so no eviction), next to the raw socket server's CPU per 64 KiB put read the same way."""
    size = 64 << 10
    keys = [i.to_bytes(16, "big") for i in range(64)]
    value = np.frombuffer(os.urandom(size), dtype=np.uint8)
    for key in keys:
        client.put(key, value)  # warm: first-touch and connection set-up not counted
    t0, cpu0 = time.perf_counter(), cpu_seconds(pid)
    for i in range(requests):
        client.put(keys[i % len(keys)], value)
    cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - t0
    for key in keys:
        client.delete(key)
    raw_cpu = None
    if raw.server_pid is not None:
        view = memoryview(value.tobytes())
        raw.put(view)  # warm, as the daemon's loop is
        raw0 = cpu_seconds(raw.server_pid)
        for _ in range(requests):
            raw.put(view)
        raw_cpu = (cpu_seconds(raw.server_pid) - raw0) / requests * 1e6
    note = (
        f"{requests:,} puts in {wall:.2f} s ({wall / requests * 1e6:.0f} µs each, wall); CPU of "
        "every daemon thread / requests, clock-tick resolution; reference: the raw socket "
        "server's CPU / requests over as many 64 KiB puts"
    )
    return Row("daemon_cpu_us/put/64KiB", cpu / requests * 1e6, "us", "raw_socket", raw_cpu, note)


def _raw_cpu_per_get(raw: RawClient, size: int, requests: int) -> float | None:
    """The raw socket server process's CPU µs per `size`-byte get (None without its pid)."""
    if raw.server_pid is None:
        return None
    raw.get(size)  # warm, as the daemon's loop is
    cpu0 = cpu_seconds(raw.server_pid)
    for _ in range(requests):
        raw.get(size)
    return (cpu_seconds(raw.server_pid) - cpu0) / requests * 1e6


def _rate(nbytes: int, fn: Callable[[], object], rounds: int) -> float:
    return nbytes / time_median(fn, rounds) / 1e9


def run(
    *,
    working_set: int = 128 << 20,
    rounds: int = 3,
    sizes: dict[str, int] | None = None,
    lookups: int = 300,
    lmcache_python: str | None = None,
    cpu_requests: int = 20_000,
    multi_client: bool = True,
    nixl: str = "also",
) -> BenchResult:
    """Measure every case over about `working_set` bytes of distinct values per size;
    LMCache's server runs under `lmcache_python` (default: this interpreter). `nixl`: "also"
    adds the NIXL data path's rows, "no" skips them, "only" measures nothing else."""
    if nixl == "only":
        only = BenchResult("net")
        only.rows += nixl_rows(max(rounds, 5))
        only.notes.append("the NIXL data path's rows only (bench net --nixl only)")
        return only
    sizes = sizes or SIZES
    largest = max(sizes.values())
    result = BenchResult("net")
    lm_python = lmcache_python or sys.executable
    dram = f"{max(256, 2 * working_set // (1 << 20) + 4 * largest // (1 << 20))}MiB"
    with (
        tempfile.TemporaryDirectory() as tmp,
        daemon(dram, tmp) as (url, pid),
        Client.connect(url) as client,
        raw_reference(largest, DEPTH) as raw,
        redis_server() as redis_client,
    ):
        missing = "redis-server or redis-py not installed"
        redis_note = redis_parser() if redis_client is not None else missing
        for label, size in sizes.items():
            result.rows += _size_rows(
                client, raw, redis_client, redis_note, lm_python, label, size, working_set, rounds
            )
        result.rows += _lookup_rows(client, lookups)
        if cpu_requests:
            result.rows.append(_daemon_cpu_row(client, pid, raw, cpu_requests))
            result.rows.append(_daemon_put_cpu_row(client, pid, raw, cpu_requests))
    if multi_client:
        result.rows += mc_rows(rounds)
    if nixl == "also":
        scale = min(working_set, 64 << 20), min(cpu_requests, 200)
        result.rows += nixl_rows(max(rounds, 5), *scale)
    result.notes.append(
        f"one client, loopback, ~{working_set >> 20} MiB of distinct values per size, median of "
        f"{rounds} rounds; pipelined = batches of {DEPTH} in flight (put_many/get_many_into, Redis "
        f"pipelines, {DEPTH} raw requests back to back). kvoffload get = get_into with CRC32C "
        "verification; put = header + CRC32C; the daemon runs in its own process."
    )
    return result


def _size_rows(
    client: Client,
    raw: RawClient,
    redis_client: Any | None,
    redis_note: str,
    lm_python: str,
    label: str,
    size: int,
    working_set: int,
    rounds: int,
) -> list[Row]:
    """put, get and their pipelined forms of `size`-byte values over about `working_set`
    bytes: kvoffload next to the raw socket, Redis and LMCache, each case in the same run."""
    rows: list[Row] = []
    n = max(DEPTH, working_set // size // DEPTH * DEPTH)
    keys = [i.to_bytes(16, "big") for i in range(n)]
    value = np.frombuffer(os.urandom(size), dtype=np.uint8)
    vbytes = value.tobytes()
    vview = memoryview(vbytes)
    out = np.empty(size, dtype=np.uint8)
    batches = [keys[i : i + DEPTH] for i in range(0, n, DEPTH)]
    total = n * size

    def kv_put(keys: list[bytes] = keys, value: np.ndarray = value) -> None:
        for key in keys:
            client.put(key, value)

    def kv_get(keys: list[bytes] = keys, out: np.ndarray = out) -> None:
        for key in keys:
            client.get_into(key, out)

    def kv_put_p(batches: list[list[bytes]] = batches, value: np.ndarray = value) -> None:
        for batch in batches:
            client.put_many([(k, value) for k in batch])

    outs = [np.empty(size, dtype=np.uint8) for _ in range(DEPTH)]

    def kv_get_p(batches: list[list[bytes]] = batches, outs: list[np.ndarray] = outs) -> None:
        for batch in batches:
            client.get_many_into(batch, outs[: len(batch)])

    def raw_put(n: int = n, view: memoryview = vview) -> None:
        for _ in range(n):
            raw.put(view)

    def raw_get(n: int = n, size: int = size) -> None:
        for _ in range(n):
            raw.get(size)

    def raw_put_p(n: int = n, view: memoryview = vview) -> None:
        for _ in range(n // DEPTH):
            raw.put(view, DEPTH)

    def raw_get_p(n: int = n, size: int = size) -> None:
        for _ in range(n // DEPTH):
            raw.get(size, DEPTH)

    cases: list[tuple[str, Callable[[], None], Callable[[], None]]] = [
        ("put", kv_put, raw_put),
        ("get", kv_get, raw_get),
        ("put_pipelined", kv_put_p, raw_put_p),
        ("get_pipelined", kv_get_p, raw_get_p),
    ]
    redis: dict[str, float] = {}
    if redis_client is not None:
        redis = redis_rates(redis_client, keys, batches, vbytes, total, rounds)
    lmcache_rates, lmcache_note = _lmcache_rates(lm_python, size, n, rounds)
    for op, kv, ref in cases:
        mine = _rate(total, kv, rounds)
        case = f"{op}/{label}"
        lm_note = f"{lmcache_note}; goal ≥ {_lmcache_goal(case)}×"
        rows.append(Row(case, mine, "GB/s", "raw_socket", _rate(total, ref, rounds)))
        rows.append(Row(case, mine, "GB/s", "redis", redis.get(op), note=redis_note))
        rows.append(Row(case, mine, "GB/s", "lmcache", lmcache_rates.get(op), note=lm_note))
    for batch in batches:
        for key in batch:
            client.delete(key)
    return rows


def _lmcache_goal(case: str) -> float:
    """Issue 29's goal against LMCache's lm:// server: 1.5× at get/64KiB, 1.0× elsewhere
    (every put included: lm:// acknowledges nothing, so a put there is cheaper by design)."""
    return 1.5 if case == "get/64KiB" else 1.0


def _lmcache_rates(python: str, size: int, count: int, rounds: int) -> tuple[dict[str, float], str]:
    """LMCache lm:// rates from `bench/peers/lmserver.py` under `python`, or ({}, why not)."""
    args = [
        python,
        "-m",
        "kvoffload.bench.peers.lmserver",
        "--size",
        str(size),
        "--count",
        str(count),
    ]
    args += ["--rounds", str(rounds), "--depth", str(DEPTH)]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=600)
        report = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return {}, f"LMCache driver under {python} failed: {exc!r}"
    if "missing" in report:
        return {}, f"lmcache not installed for {python} (see --lmcache-python)"
    if "rates" not in report:
        return {}, f"LMCache lm:// server not measured: {report.get('error', 'no result')}"
    rates = {op: float(v) for op, v in report["rates"].items()}
    return rates, f"LMCache {report['version']} lm:// server (puts are not answered)"


def _lookup_rows(client: Client, lookups: int) -> list[Row]:
    keys = [i.to_bytes(16, "big") for i in range(LOOKUP_KEYS)]
    client.put_many([(k, b"x") for k in keys], parents=[None, *keys[:-1]])
    assert client.lookup(keys) == LOOKUP_KEYS
    samples = []
    for _ in range(lookups):
        t0 = time.perf_counter()
        client.lookup(keys)
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    p50 = statistics.median(samples)
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    note = f"goal: p50 <= {LOOKUP_GOAL_MS} ms (the reference is the goal, not a peer)"
    return [
        Row(f"lookup/{LOOKUP_KEYS}keys", p50, "ms", "goal_p50", LOOKUP_GOAL_MS, note=note),
        Row(f"lookup_p99/{LOOKUP_KEYS}keys", p99, "ms", None, None, note="p99 over the same run"),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--working-set", type=int, default=128, metavar="MiB", help="distinct MiB per size"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per case (median)")
    parser.add_argument(
        "--lmcache-python", help="Python with lmcache (env KVOFFLOAD_LMCACHE_PYTHON)"
    )
    parser.add_argument(
        "--cpu-requests",
        type=int,
        default=20_000,
        help="64 KiB gets (and as many puts) for the daemon_cpu_us rows (0: skip them)",
    )
    parser.add_argument(
        "--no-multi-client",
        action="store_true",
        help="skip get_mc8/workers_scaling (8 client processes against a multi-worker daemon)",
    )

    parser.add_argument(
        "--nixl",
        choices=("also", "no", "only"),
        default="also",
        help="the NIXL data path's rows (get_nixl, put_nixl, daemon_cpu_us/get_nixl): "
        "also (default), no, or only these",
    )


def run_from_args(args: argparse.Namespace) -> BenchResult:
    python = peer_python("lmcache", args.lmcache_python, "KVOFFLOAD_LMCACHE_PYTHON")
    return run(
        working_set=args.working_set << 20,
        rounds=args.rounds,
        lmcache_python=python,
        cpu_requests=args.cpu_requests,
        multi_client=not args.no_multi_client,
        nixl=args.nixl,
    )
