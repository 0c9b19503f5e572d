"""The test network itself (bench/cluster/netns.py): what the cluster tests and `bench trace
--live cluster` rely on from it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from kvoffload.bench.cluster.netns import Network

pytestmark = [pytest.mark.integration]


def _mac(device: str, netns: str = "") -> str:
    argv = ["ip", "-j", "link", "show", device]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return str(json.loads(out)[0]["address"])


def test_the_gateways_mac_stays_put_while_hosts_join() -> None:
    # A bridge without a MAC of its own takes its lowest port's, so a host added later could
    # change the gateway's MAC under the ARP caches of the hosts before it: a node restarted
    # in its namespace then could not reach etcd until the stale entry was probed (~30 s).
    net = Network.open()
    try:
        if not net.isolated:
            pytest.skip("network namespaces are not available here (needs root)")
        before = _mac(net.bridge)
        hosts = [net.add_host() for _ in range(4)]
        assert _mac(net.bridge) == before
        # Every host reaches the gateway (a TCP connect: its ARP entry is resolved by then),
        # and at that MAC.
        listener = socket.create_server((net.gateway, 0))
        port = listener.getsockname()[1]
        connect = f"import socket; socket.create_connection(('{net.gateway}', {port}), 5)"
        for host in hosts:
            subprocess.run(
                host.command([sys.executable, "-c", connect]), capture_output=True, check=True
            )
            neigh = subprocess.run(
                host.command(["ip", "-j", "neigh", "show", net.gateway]),
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            assert json.loads(neigh)[0]["lladdr"] == before
        listener.close()
    finally:
        net.close()
