"""What tests read off a running daemon without touching its internals: metrics, public stats,
and bounded polling (the machine is shared, so tests wait for behaviour, never time it)."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from typing import Any, cast

from kvoffload.client_sdk import Client


def refused(daemon: Any, reason: str, front: str = "native") -> float:
    """kvoffload_connections_refused_total for one front and reason (0 before the first)."""
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    label = f'kvoffload_connections_refused_total{{front="{front}",reason="{reason}"}} '
    for line in text.splitlines():
        if line.startswith(label):
            return float(line[len(label) :])
    return 0.0


def pinned(client: Client) -> int:
    """DRAM blocks pinned by readers, from the store's stats."""
    tiers = cast(list[dict[str, int]], client.stats().store["tiers"])
    return tiers[0]["pinned"]


def eventually(check: Callable[[], bool], limit: float = 30.0) -> bool:
    """Poll `check` until it holds (True) or `limit` s pass (False)."""
    end = time.monotonic() + limit
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def settled(read: Callable[[], int], target: int, quiet: float = 3.0) -> int:
    """Poll `read` until it reaches `target` or stops changing for `quiet` s (60 s at most)."""
    value, since, end = read(), time.monotonic(), time.monotonic() + 60
    while value < target and time.monotonic() < min(end, since + quiet):
        time.sleep(0.1)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def small_window(port: int, rcvbuf: int = 64 << 10) -> socket.socket:
    """A connection whose receive buffer stays small (no autotuning; this machine lets it grow
    to 32 MiB), so that answers a test leaves unread stay queued in the daemon."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def closed(sock: socket.socket, limit: float = 10.0) -> bool:
    """Read whatever is left; True once the peer has closed (EOF or reset) within `limit` s."""
    sock.settimeout(limit)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True
