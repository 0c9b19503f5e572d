"""`bench net` rows of the NIXL data path (issue 16; docs/guides/nixl.md): one client against one
loopback daemon, each case measured next to its reference in the same run, alternating A/B
rounds so that a busy machine slows both alike.

UCX runs over loopback: `UCX_TLS` and `UCX_NET_DEVICES` from the environment, else
`sm,tcp` and `lo` (shared memory between the two processes, TCP for its wire-up).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import crc32c
import numpy as np

from kvoffload.bench.common import Row, cpu_seconds, daemon
from kvoffload.client_sdk import Client

__all__ = ["nixl_rows"]

_SIZES = {"2MiB": 2 << 20, "8MiB": 8 << 20}


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _ab(a: Callable[[], object], b: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median seconds of `a` and of `b`, run in alternating rounds after one warm-up each."""
    a()
    b()
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(rounds):
        ta.append(_seconds(a))
        tb.append(_seconds(b))
    return statistics.median(ta), statistics.median(tb)


def _missing(note: str) -> list[Row]:
    return [
        Row("get_nixl/2MiB", 0.0, "GB/s", "kv", None, note=note),
        Row("get_nixl/8MiB", 0.0, "GB/s", "memcpy_crc", None, note=note),
        Row("put_nixl/2MiB", 0.0, "GB/s", "kv", None, note=note),
        Row("daemon_cpu_us/get_nixl/2MiB", 0.0, "us", "kv", None, note=note),
    ]


def nixl_rows(rounds: int = 5, working_set: int = 64 << 20, cpu_requests: int = 200) -> list[Row]:
    """The four NIXL rows; rows with a note and no values where NIXL is not installed."""
    if importlib.util.find_spec("nixl") is None:
        return _missing("nixl not installed (pip install --no-deps nixl-cu12 nixl)")
    os.environ.setdefault("UCX_TLS", "sm,tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    ucx = f"UCX_TLS={os.environ['UCX_TLS']} UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}"
    rows: list[Row] = []
    # Room for the working set twice, and at least what an 8 MiB value needs (the largest
    # value a daemon takes is a fraction of its arena).
    dram = f"{max(2 * working_set, 256 << 20) // (1 << 20) + 64}MiB"
    with (
        tempfile.TemporaryDirectory() as tmp,
        daemon(dram, tmp) as (url, pid),
        Client.connect(url) as kv,
        Client.connect(f"{url}?data=nixl") as nixl,
    ):
        for label, size in _SIZES.items():
            n = max(4, working_set // size)
            keys = [i.to_bytes(16, "big") for i in range(n)]
            value = np.frombuffer(os.urandom(size), dtype=np.uint8)
            out = np.empty(size, dtype=np.uint8)
            kv.put_many([(k, value) for k in keys])

            def get(client: Client, keys: list[bytes] = keys, out: np.ndarray = out) -> None:
                for key in keys:
                    if client.get_into(key, out) is None:
                        raise RuntimeError("bench value missing")

            def put(client: Client, keys: list[bytes] = keys, value: np.ndarray = value) -> None:
                for key in keys:
                    client.put(key, value)

            total = n * size
            t_kv, t_nixl = _ab(lambda: get(kv), lambda: get(nixl), rounds)
            note = f"get_into, {n} distinct {label} values per round, median of {rounds}; {ucx}"
            if label == "2MiB":
                rows.append(
                    Row(
                        f"get_nixl/{label}",
                        total / t_nixl / 1e9,
                        "GB/s",
                        "kv",
                        total / t_kv / 1e9,
                        note=note,
                    )
                )
                p_kv, p_nixl = _ab(lambda: put(kv), lambda: put(nixl), rounds)
                rows.append(
                    Row(
                        f"put_nixl/{label}",
                        total / p_nixl / 1e9,
                        "GB/s",
                        "kv",
                        total / p_kv / 1e9,
                        note=note.replace("get_into", "put"),
                    )
                )
                rows.append(_cpu_row(kv, nixl, keys, out, pid, cpu_requests, cpu_seconds))
            else:
                src = np.frombuffer(os.urandom(size), dtype=np.uint8)
                dst = np.empty(size, dtype=np.uint8)

                def memcpy_crc(src: np.ndarray = src, dst: np.ndarray = dst, n: int = n) -> None:
                    for _ in range(n):
                        np.copyto(dst, src)
                        crc32c.crc32c(dst.data)

                t_ref, t_nixl = _ab(memcpy_crc, lambda: get(nixl), rounds)
                rows.append(
                    Row(
                        f"get_nixl/{label}",
                        total / t_nixl / 1e9,
                        "GB/s",
                        "memcpy_crc",
                        total / t_ref / 1e9,
                        note=note + "; ref: memcpy + CRC32C, one process",
                    )
                )
            for key in keys:
                kv.delete(key)
    return rows


def _cpu_row(
    kv: Client,
    nixl: Client,
    keys: list[bytes],
    out: np.ndarray,
    pid: int,
    requests: int,
    cpu_seconds: Callable[[int], float],
) -> Row:
    """Daemon CPU µs per 2 MiB get, NIXL against kv://, in alternating blocks of gets."""
    spent = {"kv": 0.0, "nixl": 0.0}
    block = max(1, requests // 10)
    for _ in range(10):
        for name, client in (("kv", kv), ("nixl", nixl)):
            c0 = cpu_seconds(pid)
            for i in range(block):
                client.get_into(keys[i % len(keys)], out)
            spent[name] += cpu_seconds(pid) - c0
    count = 10 * block
    note = (
        f"{count} gets each, alternating blocks of {block}; CPU of every daemon thread / "
        "requests, clock-tick resolution; ratio = kv / nixl"
    )
    return Row(
        "daemon_cpu_us/get_nixl/2MiB",
        spent["nixl"] / count * 1e6,
        "us",
        "kv",
        spent["kv"] / count * 1e6,
        note=note,
    )
