"""`kvoffload bench net`: one client against `kvoffload serve` on loopback, next to a raw socket
loop, Redis and LMCache's lm:// server measured in the same run.

Cases: put and get of 64 KiB, 2 MiB and 8 MiB values, one request at a time and pipelined
(`put_many`/`get_many_into` batches, the same depth for every reference), plus the p50/p99 of a
1,000-key `lookup`. kvoffload's get is `get_into` a preallocated buffer (its zero-copy path,
CRC32C verification included); its put seals a header and CRC32C.

References:
- raw_socket: a Python server process that `recv_into`s a preallocated buffer and answers with
  1 byte (put) or sends a preallocated buffer (get); the client uses `sendmsg` and `recv_into`.
  This is the floor of what any Python protocol on this machine can do.
- redis: Debian's `redis-server` (persistence off) through redis-py with its hiredis parser (as
  a Redis user runs it; the note says when hiredis is missing), `SET`/`GET`, pipelines for the
  pipelined cases. Skipped (row with a null reference) when either is not installed.

`daemon_cpu_us/get/64KiB`: the CPU time of the daemon process (all its threads, from
/proc/<pid>/stat) divided by the requests of a loop of `--cpu-requests` 64 KiB gets (goal 20 µs).
- lmcache: LMCache's own `lm://` server (`lmcache.v1.server`), driven by `bench/peers/lmserver.py`
  under a Python that has `lmcache` (`--lmcache-python`, env KVOFFLOAD_LMCACHE_PYTHON, else
  `.venv-lmcache` as `.ci/engines.sh lmcache` builds it, else this one). Its
  protocol does not answer a PUT, so its put cases end with one round trip; they are pipelined
  by nature. Skipped (a null reference with the reason) when that Python has no `lmcache`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvoffload.bench.common import (
    BenchResult,
    Row,
    free_port,
    peer_python,
    stop_process,
    time_median,
)
from kvoffload.client_sdk import Client

__all__ = ["HELP", "SIZES", "add_arguments", "run", "run_from_args"]

HELP = "native protocol vs a raw socket loop, Redis and LMCache on loopback"

SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20, "8MiB": 8 << 20}
DEPTH = 8  # requests in flight in the pipelined cases
LOOKUP_KEYS = 1000
_HDR = struct.Struct("<cQ")
_LISTEN = re.compile(r"^kvoffload: native listening on \S+:(\d+)$")


# ---------------------------------------------------------------------------- raw socket


def _raw_server(listener: socket.socket, max_size: int) -> None:
    """Serve the raw protocol to one connection after another."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        conn, _ = listener.accept()
        raw_connection(conn, max_size)


def raw_connection(conn: socket.socket, max_size: int) -> None:
    """Serve one connection: b"P" + u64 n + n bytes -> b"k"; b"G" + u64 n -> n bytes."""
    view = memoryview(bytearray(max_size))
    head = bytearray(_HDR.size)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while _recv_exact(conn, memoryview(head)):
            op, n = _HDR.unpack(head)
            if op == b"P":
                if not _recv_exact(conn, view[:n]):
                    break
                conn.sendall(b"k")
            else:
                conn.sendall(view[:n])


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    pos = 0
    while pos < len(view):
        n = sock.recv_into(view[pos:])
        if n == 0:
            return False
        pos += n
    return True


class RawClient:
    def __init__(self, port: int, max_size: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(max_size))
        self.ack = memoryview(bytearray(DEPTH))

    def _send(self, parts: list[memoryview | bytes]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            sent = self.sock.sendmsg(views)
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def put(self, value: memoryview, depth: int = 1) -> None:
        self._send([_HDR.pack(b"P", len(value)), value] * depth)
        _recv_exact(self.sock, self.ack[:depth])

    def get(self, size: int, depth: int = 1) -> None:
        self._send([_HDR.pack(b"G", size)] * depth)
        for _ in range(depth):
            _recv_exact(self.sock, self.buf[:size])

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def _raw_reference(max_size: int) -> Iterator[RawClient]:
    listener = socket.create_server(("127.0.0.1", 0))
    ctx = multiprocessing.get_context("fork")
    server = ctx.Process(target=_raw_server, args=(listener, max_size), daemon=True)
    server.start()
    client = RawClient(listener.getsockname()[1], max_size)
    listener.close()
    try:
        yield client
    finally:
        client.close()
        server.terminate()
        server.join(10)


# ---------------------------------------------------------------------------- processes


@contextlib.contextmanager
def daemon(dram: str, tmp: str, workers: int = 1) -> Iterator[tuple[str, int]]:
    """A `kvoffload serve` on loopback: (its kv:// URL, its pid)."""
    args = [
        sys.executable,
        "-m",
        "kvoffload.cli",
        "serve",
        "--port",
        "0",
        "--workers",
        str(workers),
    ]
    args += ["--nvme-port", "0", "--metrics-port", "0", "--dram", dram, "--ssd", "0"]
    args += ["--data-dir", tmp]
    # KVOFFLOAD_PURE_PYTHON reaches the daemon: a pure-Python run measures both sides so.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVOFFLOAD_") or k == "KVOFFLOAD_PURE_PYTHON"
    }
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = None
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _LISTEN.match(line.strip())
            if m:
                port = int(m.group(1))
            if line.strip() == "kvoffload: ready":
                break
        if port is None:
            raise RuntimeError("kvoffload serve did not start")
        yield f"kv://127.0.0.1:{port}", proc.pid
    finally:
        stop_process(proc)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid`, all threads (fields 14 and 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()  # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _daemon_cpu_row(client: Client, pid: int, requests: int) -> Row:
    """Daemon CPU µs per 64 KiB get over `requests` gets of a few hot keys (DRAM hits)."""
    size = 64 << 10
    keys = [i.to_bytes(16, "big") for i in range(64)]
    value = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)
    for key in keys:
        client.put(key, value)
    for key in keys:
        client.get_into(key, out)  # warm: first-touch and connection set-up not counted
    t0, cpu0 = time.perf_counter(), _cpu_seconds(pid)
    for i in range(requests):
        client.get_into(keys[i % len(keys)], out)
    cpu, wall = _cpu_seconds(pid) - cpu0, time.perf_counter() - t0
    for key in keys:
        client.delete(key)
    note = (
        f"{requests:,} gets in {wall:.2f} s ({wall / requests * 1e6:.0f} µs each, wall); CPU of "
        "every daemon thread / requests, clock-tick resolution"
    )
    return Row("daemon_cpu_us/get/64KiB", cpu / requests * 1e6, "us", "goal", 20.0, note=note)


def _redis_parser() -> str:
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return "redis-py"
    return "redis-py + hiredis" if HIREDIS_AVAILABLE else "redis-py without hiredis (slower)"


@contextlib.contextmanager
def _redis() -> Iterator[Any | None]:
    """A redis-py client to a fresh redis-server, or None (with why) when not installed."""
    server = shutil.which("redis-server")
    if server is None or importlib.util.find_spec("redis") is None:
        yield None
        return
    import redis

    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--protected-mode", "no", "--proto-max-bulk-len", "1gb"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


# ---------------------------------------------------------------------------- the run


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
        from kvoffload.bench.micro.net_nixl import nixl_rows

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
        _raw_reference(largest) as raw,
        _redis() as redis_client,
    ):
        missing = "redis-server or redis-py not installed"
        redis_note = _redis_parser() if redis_client is not None else missing
        for label, size in sizes.items():
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

            def kv_get_p(
                batches: list[list[bytes]] = batches, outs: list[np.ndarray] = outs
            ) -> None:
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
            redis_rates: dict[str, float] = {}
            if redis_client is not None:
                redis_rates = _redis_rates(redis_client, keys, batches, vbytes, total, rounds)
            lmcache_rates, lmcache_note = _lmcache_rates(lm_python, size, n, rounds)
            for op, kv, ref in cases:
                mine = _rate(total, kv, rounds)
                case = f"{op}/{label}"
                result.rows.append(Row(case, mine, "GB/s", "raw_socket", _rate(total, ref, rounds)))
                result.rows.append(
                    Row(case, mine, "GB/s", "redis", redis_rates.get(op), note=redis_note)
                )
                result.rows.append(
                    Row(case, mine, "GB/s", "lmcache", lmcache_rates.get(op), note=lmcache_note)
                )
            for batch in batches:
                for key in batch:
                    client.delete(key)
        result.rows += _lookup_rows(client, lookups)
        if cpu_requests:
            result.rows.append(_daemon_cpu_row(client, pid, cpu_requests))
    if multi_client:
        from kvoffload.bench.micro.net_mc import mc_rows

        result.rows += mc_rows(rounds)
    if nixl == "also":
        from kvoffload.bench.micro.net_nixl import nixl_rows

        scale = min(working_set, 64 << 20), min(cpu_requests, 200)
        result.rows += nixl_rows(max(rounds, 5), *scale)
    result.notes.append(
        f"one client, loopback, ~{working_set >> 20} MiB of distinct values per size, median of "
        f"{rounds} rounds; pipelined = batches of {DEPTH} in flight (put_many/get_many_into, Redis "
        f"pipelines, {DEPTH} raw requests back to back). kvoffload get = get_into with CRC32C "
        "verification; put = header + CRC32C; the daemon runs in its own process."
    )
    return result


def _redis_rates(
    r: Any, keys: list[bytes], batches: list[list[bytes]], value: bytes, total: int, rounds: int
) -> dict[str, float]:
    def put() -> None:
        for key in keys:
            r.set(key, value)

    def get() -> None:
        for key in keys:
            r.get(key)

    def put_p() -> None:
        for batch in batches:
            pipe = r.pipeline(transaction=False)
            for key in batch:
                pipe.set(key, value)
            pipe.execute()

    def get_p() -> None:
        for batch in batches:
            pipe = r.pipeline(transaction=False)
            for key in batch:
                pipe.get(key)
            pipe.execute()

    rates = {
        "put": _rate(total, put, rounds),
        "get": _rate(total, get, rounds),
        "put_pipelined": _rate(total, put_p, rounds),
        "get_pipelined": _rate(total, get_p, rounds),
    }
    r.flushall()
    return rates


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
    note = "goal: p50 <= 2 ms (the reference is the goal, not a peer)"
    return [
        Row(f"lookup/{LOOKUP_KEYS}keys", p50, "ms", "goal_p50", 2.0, note=note),
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
        help="64 KiB gets for the daemon_cpu_us row (0: skip it)",
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
