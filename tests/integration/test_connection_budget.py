"""Connections that never say Hello have a budget of their own (in all and per peer address)
and cannot lock authenticated tenants out (the trust issue's defect 7)."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from kvoffload.client_sdk import Client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

Start = Callable[..., Any]
# A long hello deadline: what frees room here is the budget, not the watchdog.
CONFIG = """
[native]
max_connections = {total}
max_unauthenticated = {waiting}
max_unauthenticated_per_peer = {per_peer}
hello_timeout_s = 600.0
[tenants.alice]
token = "alice-secret"
"""


def _idle(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), 10, source_address=(source, 0))
    sock.settimeout(10)  # an upper bound for reads below, never asserted on
    return sock


def _closed_by_daemon(sock: socket.socket) -> bool:
    try:
        while sock.recv(4096):  # an error reply may come first, then EOF
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _refused(daemon: Any, reason: str) -> float:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("kvoffload_connections_refused_total") and f'"{reason}"' in line:
            return float(line.split()[-1])
    return 0.0


def test_idle_connections_do_not_lock_a_tenant_out(start_daemon: Start) -> None:
    daemon = start_daemon(config=CONFIG.format(total=8, waiting=4, per_peer=4))
    idle = [_idle(daemon.port) for _ in range(12)]  # three times the budget, never a Hello
    try:
        for _ in range(3):  # every time a tenant connects, it finds room
            with Client.connect(daemon.url(token="alice-secret", retries="0")) as alice:
                alice.put(b"k" * 16, b"alice's block")
                assert alice.get(b"k" * 16) == b"alice's block"
        assert _closed_by_daemon(idle[0])  # the oldest made room
        assert _refused(daemon, "unauthenticated per peer") >= 8
    finally:
        for sock in idle:
            sock.close()


def test_authenticated_connections_always_find_room(start_daemon: Start) -> None:
    daemon = start_daemon(config=CONFIG.format(total=4, waiting=4, per_peer=4))
    url = daemon.url(token="alice-secret", retries="0")
    tenants = [Client.connect(url) for _ in range(3)]
    idle = [_idle(daemon.port)]  # the 4th and last connection
    try:
        with Client.connect(url) as last:  # the idle one goes, the tenants stay
            assert last.get(b"x" * 16) is None
        assert _closed_by_daemon(idle[0])
        for client in tenants:
            client.put(b"y" * 16, b"still here")
    finally:
        for client in tenants:
            client.close()
        for sock in idle:
            sock.close()


def test_the_per_peer_budget_closes_that_peers_oldest(start_daemon: Start) -> None:
    daemon = start_daemon(config=CONFIG.format(total=64, waiting=16, per_peer=2))
    other = [_idle(daemon.port, "127.0.0.3") for _ in range(2)]
    mine = [_idle(daemon.port, "127.0.0.2") for _ in range(3)]  # one over: its first goes
    try:
        assert _closed_by_daemon(mine[0])
        assert _refused(daemon, "unauthenticated per peer") == 1
        assert _refused(daemon, "unauthenticated") == 0
        with Client.connect(daemon.url(token="alice-secret", retries="0")) as alice:
            assert alice.get(b"z" * 16) is None
    finally:
        for sock in other + mine:
            sock.close()


# The NVMe/TCP front (no tenants: it does not start with them): connections that never finish
# ICReq and Connect have the same kind of budget, so they cannot hold every slot.
NVME_CONFIG = """
[nvme]
max_connections = {total}
max_unconnected = {waiting}
max_unconnected_per_peer = {per_peer}
connect_timeout_s = 600.0
"""


def test_unconnected_nvme_connections_do_not_lock_hosts_out(start_daemon: Start) -> None:
    daemon = start_daemon(config=NVME_CONFIG.format(total=8, waiting=4, per_peer=4))
    port = daemon.ports["nvme"]
    idle = [_idle(port) for _ in range(12)]  # three times the budget, never an ICReq
    try:
        for i in range(2):  # a host (admin queue + I/O queues) still finds room each time
            with Client.connect(daemon.nvme_url()) as host:
                host.put(bytes([i]) * 16, b"a block over NVMe/TCP")
                assert host.get(bytes([i]) * 16) == b"a block over NVMe/TCP"
        assert _closed_by_daemon(idle[0])  # the oldest made room
        assert _refused(daemon, "unconnected per peer") >= 8
    finally:
        for sock in idle:
            sock.close()


def test_the_nvme_per_peer_budget_closes_that_peers_oldest(start_daemon: Start) -> None:
    daemon = start_daemon(config=NVME_CONFIG.format(total=64, waiting=16, per_peer=2))
    port = daemon.ports["nvme"]
    other = [_idle(port, "127.0.0.3") for _ in range(2)]
    mine = [_idle(port, "127.0.0.2") for _ in range(3)]  # one over: its first goes
    try:
        assert _closed_by_daemon(mine[0])
        assert _refused(daemon, "unconnected per peer") == 1
        assert _refused(daemon, "unconnected") == 0
        assert not _closed_by_daemon_soon(other[0])
    finally:
        for sock in other + mine:
            sock.close()


def _closed_by_daemon_soon(sock: socket.socket) -> bool:
    """Whether the daemon has closed `sock` already (a short look, not a wait)."""
    sock.settimeout(0.5)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
