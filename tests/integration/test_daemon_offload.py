"""With an SSD tier, the engine calls that may wait on the device run on the daemon's I/O
threads: reserving (which may evict blocks to the SSD), committing and deleting (which wipes a
slot). One connection whose SSD write is stuck must not stall the others.

The daemon runs in this process, on its own thread, so that a test can hold an engine call
the way a slow device would (fault injection: the engine is real, one method waits on a gate).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from probes import closed, eventually, refused, small_window

from kvoffload.client_sdk import Client
from kvoffload.client_sdk.transports.nvme import NvmeHost, NvmeOptions
from kvoffload.kvstore import Engine, PutReservation
from kvoffload.nvmeof_target.config import DEFAULT_SUBNQN, load_config
from kvoffload.nvmeof_target.server import Daemon
from kvoffload.wire.native.connection import Get, Hello, NativeConnection, Put, Role
from kvoffload.wire.nvme_tcp.cmd import Completion, StoreOption

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class Gate:
    """Holds every call (or only the first, with `once`) of the method it wraps, once armed,
    until released."""

    def __init__(self, *, once: bool = False) -> None:
        self.armed = False
        self.once = once
        self.entered = threading.Event()
        self.release = threading.Event()

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            if self.armed and not (self.once and self.entered.is_set()):
                self.entered.set()
                self.release.wait(60)
            return real(*args, **kwargs)

        return gated


@contextlib.contextmanager
def serving(tmp: Path, **settings: str) -> Iterator[Daemon]:
    """A daemon with a DRAM and an SSD tier on its own event loop thread in this process;
    `settings` as environment variables (NATIVE__FRAME_TIMEOUT_S="1")."""
    argv = ["--port", "0", "--nvme-port", "0", "--metrics-port", "0", "--loop", "asyncio"]
    argv += ["--dram", "64MiB", "--ssd", "64MiB", "--data-dir", str(tmp / "data")]
    environ = {f"KVOFFLOAD_{k}": v for k, v in settings.items()}
    daemon = Daemon(load_config(None, environ, argv), out=io.StringIO())
    ready = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        try:
            await daemon.start()
            ready.set()
            await daemon.wait()
        finally:
            await daemon.stop()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(60), "the daemon did not start"
    try:
        yield daemon
    finally:
        loops[0].call_soon_threadsafe(daemon.request_stop)
        thread.join(60)


def _url(daemon: Daemon, front: str, **params: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    _, port = daemon.addresses[front]
    if front == "nvme":
        return f"nvme+tcp://127.0.0.1:{port}/{DEFAULT_SUBNQN}?{query}"
    return f"kv://127.0.0.1:{port}?{query}"


@pytest.mark.parametrize("front", ["native", "nvme"])
@pytest.mark.parametrize("op", ["reserve", "commit", "delete"])
def test_a_stuck_ssd_write_holds_up_only_its_own_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, front: str, op: str
) -> None:
    gate = Gate()
    owner: type[Any] = PutReservation if op == "commit" else Engine
    monkeypatch.setattr(owner, op, gate.wrap(getattr(owner, op)))
    key, other = os.urandom(16), os.urandom(16)
    with (
        serving(tmp_path) as daemon,
        Client.connect(_url(daemon, front, timeout="60")) as writer,
        # If the loop were held, this client's requests would time out: 3 s is plenty here.
        Client.connect(_url(daemon, front, timeout="3", retries="0")) as reader,
    ):
        writer.put(key, b"old")
        writer.put(other, b"other")
        gate.armed = True
        results: list[object] = []

        def write() -> None:
            results.append(writer.delete(key) if op == "delete" else writer.put(key, b"new"))

        thread = threading.Thread(target=write)
        thread.start()
        try:
            assert gate.entered.wait(60)  # the writer's engine call is stuck, as on a slow SSD
            assert reader.get(other) == b"other"  # ... and another connection is served
            assert reader.exists(key)
        finally:
            gate.release.set()
            thread.join(60)
        assert len(results) == 1
        assert reader.get(key) == (None if op == "delete" else b"new")


def test_a_connection_cut_off_while_its_reserve_is_stuck_gives_the_slot_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate()
    monkeypatch.setattr(Engine, "reserve", gate.wrap(Engine.reserve))
    keys = [os.urandom(16) for _ in range(20)]
    with (
        serving(tmp_path, NATIVE__FRAME_TIMEOUT_S="1") as daemon,
        Client.connect(_url(daemon, "native")) as client,
    ):
        for key in keys:
            client.put(key, os.urandom(1 << 20))
        used = _dram(client)["used_bytes"]
        gate.armed = True
        conn = NativeConnection(Role.CLIENT)
        stream = [conn.send(Hello(1))] + [conn.send(Get(i, k)) for i, k in enumerate(keys, 2)]
        stream.append(conn.send(Put(99, os.urandom(16), 1 << 20), [bytes(1 << 20)]))
        with small_window(daemon.addresses["native"][1]) as sock:
            # Gets whose answers it never reads, then a put whose reservation gets stuck: the
            # send timeout cuts the connection off while its reader waits for that reservation.
            sock.sendall(b"".join(stream[:-1]))
            sock.sendall(stream[-1][:4096])
            assert gate.entered.wait(60)
            _, port = daemon.addresses["metrics"]
            metrics = SimpleNamespace(metrics_url=f"http://127.0.0.1:{port}/metrics")
            try:
                assert eventually(lambda: refused(metrics, "send timeout") == 1.0)
            finally:
                gate.release.set()
            assert closed(sock)
        # The reservation made after the connection was gone is given back, and every view its
        # Gets pinned is released.
        assert eventually(lambda: _dram(client)["used_bytes"] == used)
        assert _dram(client)["pinned"] == 0


def test_a_conditional_nvme_store_is_checked_atomically_with_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With an SSD tier the commit runs on an I/O thread; a check made before it could be stale.
    gate = Gate(once=True)
    monkeypatch.setattr(PutReservation, "commit", gate.wrap(PutReservation.commit))
    key = os.urandom(16)
    with serving(tmp_path) as daemon, Client.connect(_url(daemon, "native")) as other:
        host = NvmeHost(NvmeOptions(port=daemon.addresses["nvme"][1], kato_ms=0))
        try:
            gate.armed = True
            results: list[Completion] = []
            absent = StoreOption.ONLY_IF_ABSENT

            def store() -> None:
                results.append(host.store(key, [b"first"], options=absent))

            thread = threading.Thread(target=store)
            thread.start()
            try:
                assert gate.entered.wait(60)  # the key was absent when the store arrived ...
                other.put(key, b"second")  # ... and another connection stores it meanwhile
            finally:
                gate.release.set()
                thread.join(60)
            assert [(c.sct, c.sc) for c in results] == [(0, 0x89)]  # Key Exists
            assert other.get(key) == b"second"
        finally:
            host.close()


def _dram(client: Client) -> dict[str, int]:
    return cast(list[dict[str, int]], client.stats().store["tiers"])[0]
