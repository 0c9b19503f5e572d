"""Redis as a reference of `bench net`: a fresh `redis-server` on loopback driven by redis-py
(with its C parser, hiredis, where installed) the way a Redis user runs it."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvoffload.bench.common import free_port, time_median

__all__ = ["redis_parser", "redis_rates", "redis_server"]


def redis_parser() -> str:
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return "redis-py"
    return "redis-py + hiredis" if HIREDIS_AVAILABLE else "redis-py without hiredis (slower)"


@contextlib.contextmanager
def redis_server() -> Iterator[Any | None]:
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


def redis_rates(
    r: Any, keys: list[bytes], batches: list[list[bytes]], value: bytes, total: int, rounds: int
) -> dict[str, float]:
    """GB/s of set/get and pipelined set/get of `value` under `keys`, median of `rounds`."""

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


def _rate(nbytes: int, fn: Callable[[], object], rounds: int) -> float:
    return nbytes / time_median(fn, rounds) / 1e9
