"""LMCache's `lm://` server as a reference for `kvoffload bench net`.

Run by the net bench under a Python that has `lmcache` (``python -m kvoffload.bench.peers.lmserver
--size N --count N``): starts LMCache's own server (``python -m lmcache.v1.server HOST PORT
cpu``) and drives it over loopback with LMCache's protocol classes the way its
`LMCServerConnector` does (``sendall`` of a `ClientMetaMessage` and the bytes; a get receives
a `ServerMetaMessage`, then ``recv_into`` a preallocated buffer). Prints one JSON object of
GB/s per case. Every value read back is compared with what was put, once, before timing.

The protocol has no reply to a PUT, so a put case ends with one EXIST round trip: that is when
the server has taken every value (it serves a connection in order).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvoffload.bench.common import free_port


@contextmanager
def _server() -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120  # importing torch and lmcache takes seconds
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("LMCache's lm:// server did not start") from None
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _LmClient:
    def __init__(self, port: int, size: int) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage

        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.size = size
        self.buf = memoryview(bytearray(size))
        self.reply = memoryview(bytearray(ServerMetaMessage.packlength()))
        self._parse = ServerMetaMessage.deserialize
        shape = torch.Size([size])

        def meta(command: Any, i: int, length: int) -> bytes:
            key = CacheEngineKey("bench", 1, 0, i, torch.uint8)
            return bytes(
                ClientMetaMessage(
                    command, key, length, MemoryFormat.KV_2LTD, torch.uint8, shape
                ).serialize()
            )

        self.put_meta: Callable[[int], bytes] = lambda i: meta(ClientCommand.PUT, i, size)
        self.get_meta: Callable[[int], bytes] = lambda i: meta(ClientCommand.GET, i, 0)
        self.exist_meta = meta(ClientCommand.EXIST, -1, 0)

    def _recv_exact(self, view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            n = self.sock.recv_into(view[pos:])
            if n == 0:
                raise ConnectionError("the lm:// server closed the connection")
            pos += n

    def put(self, metas: list[bytes], value: bytes) -> None:
        for meta in metas:
            self.sock.sendall(meta)
            self.sock.sendall(value)
        self.sock.sendall(self.exist_meta)  # the round trip that ends a put case
        self._recv_exact(self.reply)

    def get(self, metas: list[bytes]) -> None:
        self.sock.sendall(b"".join(metas))
        for _ in metas:
            self._recv_exact(self.reply)
            reply = self._parse(bytes(self.reply))
            if reply.length != self.size:
                raise RuntimeError(f"lm:// get returned {reply.length} bytes, not {self.size}")
            self._recv_exact(self.buf)


def measure(size: int, count: int, rounds: int, depth: int) -> dict[str, float]:
    value = os.urandom(size)
    total = size * count
    with _server() as port:
        client = _LmClient(port, size)
        puts = [client.put_meta(i) for i in range(count)]
        gets = [client.get_meta(i) for i in range(count)]
        client.put(puts, value)
        client.get(gets[:1])
        if bytes(client.buf) != value:
            raise RuntimeError("lm:// get returned other bytes than were put")

        def timed(fn: Callable[[], None]) -> float:
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return total / statistics.median(times) / 1e9

        batches = [gets[i : i + depth] for i in range(0, count, depth)]

        def get_each() -> None:
            for meta in gets:
                client.get([meta])

        def get_pipelined() -> None:
            for batch in batches:
                client.get(batch)

        rates = {
            "put": timed(lambda: client.put(puts, value)),
            "get": timed(get_each),
            "get_pipelined": timed(get_pipelined),
        }
        # A put never waits for the server, so the pipelined put is the same loop.
        rates["put_pipelined"] = rates["put"]
        client.sock.close()
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, required=True, help="bytes per value")
    parser.add_argument("--count", type=int, required=True, help="distinct values")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=8, help="gets in flight, pipelined case")
    args = parser.parse_args(argv)
    result: dict[str, Any]
    if importlib.util.find_spec("lmcache") is None:
        result = {"missing": "lmcache"}
    else:
        try:
            result = {"version": importlib.metadata.version("lmcache")}
            result["rates"] = measure(args.size, args.count, args.rounds, args.depth)
        except Exception as exc:  # reported to the bench as a note, not a crash
            result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result))
    return 0 if "rates" in result else 1


if __name__ == "__main__":
    sys.exit(main())
