"""The C Get path's pins and flow control, on both paths: a daemon on the C core (its Gets
answered by `HotGets`) and one on KVOFFLOAD_PURE_PYTHON=1 must hold the same bounds.

- answers a reader never takes keep their blocks pinned only while the connection lives: a
  disconnect, or the daemon stopping, gives every pin back;
- `native.max_inflight_bytes` bounds what one connection's unread answers pin.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

import pytest
from probes import eventually, pinned, settled, small_window

from kvoffload.client_sdk import Client
from kvoffload.wire.native.connection import Get, Hello, NativeConnection, Role

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(find_spec("kvoffload.core._core") is None, reason="the C core is not built"),
]
Start = Callable[..., Any]
MIB = 1 << 20
KEYS = [i.to_bytes(16, "big") for i in range(1, 9)]
PATHS = {"c": {"KVOFFLOAD_REQUIRE_EXT": "1"}, "python": {"KVOFFLOAD_PURE_PYTHON": "1"}}


def _stalled_gets(port: int, count: int) -> socket.socket:
    """A connection that asks for `count` 1 MiB blocks in one go and reads nothing."""
    sock = small_window(port, 4096)
    conn = NativeConnection(Role.CLIENT)
    frames = [conn.send(Hello(1))]
    frames += [conn.send(Get(2 + i, KEYS[i % len(KEYS)])) for i in range(count)]
    sock.sendall(b"".join(frames))
    return sock


def _seed(daemon: Any) -> Client:
    client = Client.connect(daemon.url())
    for key in KEYS:
        client.put(key, bytes([key[-1]]) * MIB)
    return client


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_reader_that_goes_away_leaves_no_pin(start_daemon: Start, path: str) -> None:
    daemon = start_daemon("--dram", "32MiB", env=PATHS[path])
    with _seed(daemon) as client:
        sock = _stalled_gets(daemon.port, 24)
        assert eventually(lambda: pinned(client) > 0)  # answers queued, their blocks pinned
        hot = client.stats().store["server"]["hot_gets"]  # type: ignore[index]
        assert (hot >= 1) == (path == "c")  # type: ignore[operator]
        sock.close()
        assert eventually(lambda: pinned(client) == 0)
        assert client.get(KEYS[0]) == bytes([KEYS[0][-1]]) * MIB


@pytest.mark.parametrize("path", sorted(PATHS))
def test_unread_answers_pin_no_more_than_max_inflight_bytes(start_daemon: Start, path: str) -> None:
    config = '[native]\nmax_inflight_bytes = "3MiB"\n'
    daemon = start_daemon("--dram", "32MiB", config=config, env=PATHS[path])
    with _seed(daemon) as client:
        sock = _stalled_gets(daemon.port, 64)
        # Answers stop once 3 MiB wait unsent: at most that many blocks (plus the one whose
        # answer crossed the line) stay pinned, however many gets were asked for.
        held = settled(lambda: pinned(client), len(KEYS))
        assert 0 < held <= 4
        sock.close()
        assert eventually(lambda: pinned(client) == 0)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_stopping_the_daemon_under_a_stalled_reader(start_daemon: Start, path: str) -> None:
    daemon = start_daemon("--dram", "32MiB", env=PATHS[path])
    with _seed(daemon) as client:
        sock = _stalled_gets(daemon.port, 24)
        assert eventually(lambda: pinned(client) > 0)
    assert daemon.stop() == 0  # the stalled answers are dropped after the send timeout
    sock.close()
    assert "Traceback" not in daemon.stderr()
