"""`kvoffload bench nvme`: the NVMe/TCP KV front next to the native front of the same daemon.

One `kvoffload serve` process serves both fronts; one SDK client per front stores (`put`) and
retrieves (`get_into`, verified) 4 KiB, 1 MiB and 8 MiB values one at a time, with NVMe/TCP
digests off and on (CRC32C header + data digests). The reference is the native protocol
(`kv://`) measured in the same run, so the ratio is NVMe/TCP ÷ native (goal: >= 0.6 at 1 MiB
with digests off).

With the daemon's defaults a 1 MiB value travels in the command capsule (one round trip) and an
8 MiB value is fetched by the target with R2T + H2CData (MAXH2CDATA 1 MiB).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np

from kvoffload.bench.common import BenchResult, Row, stop_process
from kvoffload.client_sdk import Client

__all__ = ["HELP", "SIZES", "add_arguments", "run", "run_from_args"]

HELP = "NVMe/TCP KV front vs the native front of the same daemon, digests off and on"

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "8MiB": 8 << 20}
_LISTEN = re.compile(r"^kvoffload: (\S+) listening on \S+:(\d+)$")
SUBNQN = "nqn.2026-11.io.kvoffload:store"


@contextlib.contextmanager
def _daemon(dram: str, tmp: str) -> Iterator[dict[str, int]]:
    """A daemon with both fronts on free ports; yields front name -> port."""
    args = [sys.executable, "-m", "kvoffload.cli", "serve", "--port", "0"]
    args += ["--nvme-port", "0", "--metrics-port", "0", "--dram", dram, "--ssd", "0"]
    args += ["--data-dir", tmp]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    try:
        ports: dict[str, int] = {}
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _LISTEN.match(line.strip())
            if m:
                ports[m.group(1)] = int(m.group(2))
            if line.strip() == "kvoffload: ready":
                break
        if "native" not in ports or "nvme" not in ports:
            raise RuntimeError(f"kvoffload serve did not start both fronts: {ports}")
        yield ports
    finally:
        stop_process(proc)


def _interleaved(
    cases: dict[str, Callable[[], None]], nbytes: int, rounds: int
) -> dict[str, float]:
    """GB/s of each case: the median of `rounds` timings, the cases taking turns in each round
    (after one warm-up each), so that a busy moment on a shared machine hits all of them."""
    for fn in cases.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: nbytes / statistics.median(times) / 1e9 for name, times in samples.items()}


def run(
    *, working_set: int = 64 << 20, rounds: int = 3, sizes: dict[str, int] | None = None
) -> BenchResult:
    """Measure every case over about `working_set` bytes of distinct values per size."""
    sizes = sizes or SIZES
    result = BenchResult("nvme")
    largest = max(sizes.values())
    dram = f"{max(256, 3 * working_set // (1 << 20) + 8 * largest // (1 << 20))}MiB"
    with tempfile.TemporaryDirectory() as tmp, _daemon(dram, tmp) as ports:
        native_url = f"kv://127.0.0.1:{ports['native']}"
        nvme_url = f"nvme+tcp://127.0.0.1:{ports['nvme']}/{SUBNQN}?queues=2"
        with (
            Client.connect(native_url) as native,
            Client.connect(nvme_url) as plain,
            Client.connect(nvme_url + "&hdgst=1&ddgst=1") as digests,
        ):
            for label, size in sizes.items():
                n = max(8, working_set // size)
                value = np.frombuffer(os.urandom(size), dtype=np.uint8)
                out = np.empty(size, dtype=np.uint8)
                keys = [os.urandom(16) for _ in range(n)]
                total = n * size

                def put(client: Client, keys: list[bytes] = keys, v: np.ndarray = value) -> None:
                    for key in keys:
                        client.put(key, v)

                def get(client: Client, keys: list[bytes] = keys, o: np.ndarray = out) -> None:
                    for key in keys:
                        if client.get_into(key, o) != len(o):
                            raise RuntimeError("a stored block was not read back")

                cases: dict[str, Callable[[], None]] = {}
                for name, client in (("native", native), ("", plain), ("_digests", digests)):
                    cases[f"store{name}"] = functools.partial(put, client)
                    cases[f"retrieve{name}"] = functools.partial(get, client)
                rates = _interleaved(cases, total, rounds)
                for op in ("store", "retrieve"):
                    for suffix in ("", "_digests"):
                        result.rows.append(
                            Row(
                                f"{op}{suffix}/{label}",
                                rates[op + suffix],
                                "GB/s",
                                "native",
                                rates[op + "native"],
                            )
                        )
                for key in keys:
                    native.delete(key)
    result.notes.append(
        f"one client per front, one request at a time, loopback, ~{working_set >> 20} MiB of "
        f"distinct values per size, median of {rounds} rounds taken in turns. store = put "
        "(header + CRC32C seal), retrieve = get_into (verified). *_digests = NVMe/TCP header "
        "and data digests (CRC32C) on. The daemon runs in its own process and serves both "
        "fronts. Goal: NVMe/TCP >= 0.6x native at 1 MiB with digests off."
    )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--working-set", type=int, default=64, metavar="MiB", help="distinct MiB per size"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per case (median)")


def run_from_args(args: argparse.Namespace) -> BenchResult:
    return run(working_set=args.working_set << 20, rounds=args.rounds)
