"""Network namespaces for cluster tests and `bench trace --live cluster`: a bridge in the
caller's namespace and one namespace per storage node, each joined to the bridge by a veth pair
and given its own 10.77.x.y/24 address.

Names carry a random token, so parallel runs never collide; `close` removes everything it made
(namespaces, their processes, the bridge) and every `ip` call is bounded. Where namespaces
cannot be made (no root, no CAP_NET_ADMIN), `Network.open` falls back to loopback and prints
that it did; nodes then share 127.0.0.1 on different ports (KVOFFLOAD_TEST_NO_NETNS=1 forces
this). `Network.open(fallback=False)` raises `ConfigError` instead (a benchmark that promises
namespaces must not quietly measure loopback).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
from dataclasses import dataclass, field

from kvoffload.errors import ConfigError

_IP_TIMEOUT_S = 10


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=check
    )


def _free_subnet() -> int:
    """A third octet x with no 10.77.x.0/24 address on this host."""
    used = _ip("-o", "-4", "addr", "show").stdout
    for _ in range(64):
        x = 1 + secrets.randbelow(254)
        if f"10.77.{x}." not in used:
            return x
    raise RuntimeError("no free 10.77.x.0/24 subnet")


@dataclass
class Host:
    """Where one node runs: its namespace ('' on loopback) and address."""

    netns: str
    address: str
    veth: str = ""  # the bridge's end of its veth pair (in the caller's namespace)
    peer: str = ""  # the node's end, inside its namespace

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv

    def link(self, up: bool) -> None:
        """Bring this host's link up or down (packets vanish, no reset)."""
        assert self.veth, "loopback hosts have no link to cut"
        _ip("link", "set", self.veth, "up" if up else "down")

    def blackhole(self) -> None:
        """Take the node's own end of its link down, inside its namespace: from then on its
        packets vanish both ways and nothing sends a reset (its sockets stay open)."""
        assert self.peer, "loopback hosts have no link to cut"
        _ip("netns", "exec", self.netns, "ip", "link", "set", self.peer, "down")


@dataclass
class Network:
    isolated: bool
    gateway: str  # the test namespace's address on the bridge (etcd and clients live here)
    token: str = ""
    subnet: int = 0
    hosts: list[Host] = field(default_factory=list)

    @classmethod
    def open(cls, fallback: bool = True) -> Network:
        """A new bridge; with `fallback`, loopback (printed) where namespaces cannot be made.

        Raises:
            ConfigError: namespaces cannot be made and `fallback` is False (says why).
        """
        token = secrets.token_hex(3)
        bridge = f"kvb{token}"
        try:
            if os.environ.get("KVOFFLOAD_TEST_NO_NETNS"):  # to exercise the fallback
                raise RuntimeError("KVOFFLOAD_TEST_NO_NETNS is set")
            subnet = _free_subnet()
            # A fixed (locally administered) MAC: a bridge without one takes its lowest port's,
            # so adding a host changed the gateway's MAC under the others' ARP caches, and a
            # node restarted in its namespace could not reach etcd for ~30 s (until the stale
            # entry was probed again).
            mac = "02:" + ":".join(token[i : i + 2] for i in range(0, 6, 2)) + ":00:01"
            _ip("link", "add", bridge, "address", mac, "type", "bridge")
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            if not fallback:
                raise ConfigError(
                    f"cannot create network namespaces ({_why(exc)}): this needs root "
                    "(CAP_NET_ADMIN) and iproute2's `ip`"
                ) from None
            print(f"\nnetns: cannot create namespaces ({_why(exc)}); nodes use 127.0.0.1 ports")
            return cls(False, "127.0.0.1")
        net = cls(True, f"10.77.{subnet}.1", token, subnet)
        try:
            _ip("addr", "add", f"{net.gateway}/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
        except subprocess.SubprocessError:
            net.close()
            raise
        return net

    @property
    def bridge(self) -> str:
        return f"kvb{self.token}"

    def add_host(self) -> Host:
        """A new namespace on the bridge (or a loopback host)."""
        i = len(self.hosts)
        if not self.isolated:
            host = Host("", "127.0.0.1")
            self.hosts.append(host)
            return host
        peer = f"kvp{self.token}{i}"
        host = Host(
            f"kvns{self.token}{i}", f"10.77.{self.subnet}.{10 + i}", f"kvh{self.token}{i}", peer
        )
        self.hosts.append(host)  # before creating: close() removes what half-exists
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", host.netns)
        _ip("link", "set", host.veth, "master", self.bridge)
        _ip("link", "set", host.veth, "up")
        inside = ("netns", "exec", host.netns, "ip")
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "addr", "add", f"{host.address}/24", "dev", peer)
        _ip(*inside, "link", "set", peer, "up")
        return host

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them and the bridge (errors ignored: this
        runs after failures too)."""
        for host in self.hosts:
            if not host.netns:
                continue
            pids = _ip("netns", "pids", host.netns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", host.netns, check=False)  # takes its veth pair with it
            _ip("link", "del", host.veth, check=False)
        if self.isolated:
            _ip("link", "del", self.bridge, check=False)
        self.hosts.clear()


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return (exc.stderr or str(exc)).strip()
    return str(exc)
