"""A cluster to break on purpose: etcd and N `kvoffload serve --cluster` nodes, each node in a
network namespace of its own (`netns`), and the two faults of issue 32's live replay.

- `kill`: SIGKILL of the node's daemon. The kernel resets its connections, so clients learn at
  once; its etcd record lives until its lease lapses (`lease_ttl_s`).
- `blackhole`: the node's end of its veth taken down inside its namespace. Its packets vanish
  both ways and nothing resets a connection: a client learns only from its deadline (the
  cluster URL's `timeout`); the node cannot renew its lease either, so its record lapses too.

Needs root (namespaces); `ConfigError` says so otherwise, never a silent loopback run. Everything
is undone on exit, on errors and on Ctrl-C too: nodes stopped (then the namespaces' processes
killed), etcd stopped, namespaces and bridge deleted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvoffload.bench.cluster.etcd import Etcd
from kvoffload.bench.cluster.netns import Host, Network
from kvoffload.bench.common import daemon_ports
from kvoffload.client_sdk import Client
from kvoffload.errors import ConfigError

__all__ = ["FAULTS", "NetnsCluster"]

FAULTS = ("kill", "blackhole")
NAME = "bench"  # the cluster's name in etcd


@dataclass
class NetnsNode:
    host: Host
    proc: subprocess.Popen[str]
    ports: dict[str, int]

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.ports['native']}"


class NetnsCluster:
    """etcd on the bridge and `nodes` daemons of `dram` each, one namespace each (a context
    manager: started on enter, all of it removed on exit)."""

    def __init__(self, nodes: int = 3, dram: str = "64MiB", lease_ttl_s: int = 3) -> None:
        if nodes < 1:
            raise ConfigError("a cluster needs at least one node")
        self.size, self.dram, self.lease_ttl_s = nodes, dram, lease_ttl_s
        self.nodes: list[NetnsNode] = []
        self.node_ids: list[str] = []
        self.faults: list[dict[str, object]] = []
        self._net: Network | None = None
        self._etcd: Etcd | None = None
        self._scratch: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> NetnsCluster:
        if os.geteuid() != 0:
            raise ConfigError("a cluster in network namespaces needs root (run as root)")
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _start(self) -> None:
        self._scratch = tempfile.TemporaryDirectory(prefix="kvoffload-netns-")
        scratch = Path(self._scratch.name)
        self._net = Network.open(fallback=False)
        self._etcd = Etcd(scratch / "etcd", host=self._net.gateway)
        self._etcd.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
        starting = []
        for i in range(self.size):  # all at once: each takes seconds to import and open
            host = self._net.add_host()
            env.update(KVOFFLOAD_NVME__HOST=host.address, KVOFFLOAD_METRICS__HOST=host.address,
                       KVOFFLOAD_CLUSTER__LEASE_TTL_S=str(self.lease_ttl_s))  # fmt: skip
            argv = [
                sys.executable, "-m", "kvoffload.cli", "serve", "--host", host.address,
                "--port", "7480", "--nvme-port", "0", "--metrics-port", "0", "--dram", self.dram,
                "--ssd", "0", "--data-dir", str(scratch / f"node{i}"),
                "--cluster", f"etcd://{self._etcd.endpoint}/{NAME}",
            ]  # fmt: skip
            err = scratch / f"node{i}.stderr"
            with open(err, "w") as err_file:
                proc = subprocess.Popen(host.command(argv), stdout=subprocess.PIPE,
                                        stderr=err_file, text=True, env=dict(env))  # fmt: skip
            starting.append((host, proc, err))
        for host, proc, err in starting:
            try:
                ports = daemon_ports(proc, err)
            except RuntimeError as exc:
                raise ConfigError(str(exc)) from None
            self.nodes.append(NetnsNode(host, proc, ports))
        self.node_ids = self._wait_members(timeout_s=30)

    def url(self, replicas: int = 2, timeout_s: float = 1.0, immutable: bool = False) -> str:
        assert self._etcd is not None, "not started"
        return (f"cluster+etcd://{self._etcd.endpoint}/{NAME}"
                f"?replicas={replicas}&timeout={timeout_s:g}"
                + ("&immutable=1" if immutable else ""))  # fmt: skip

    def _wait_members(self, timeout_s: float) -> list[str]:
        """Until a client sees every node as a member: their ids, in `nodes` order."""
        deadline = time.monotonic() + timeout_s
        want = {n.address for n in self.nodes}
        with Client.connect(self.url()) as client:
            while True:
                nodes = client.stats().store["nodes"]
                assert isinstance(nodes, dict)
                by_address = {str(v["fronts"]["native"]): k for k, v in nodes.items()}
                if want <= set(by_address):
                    return [by_address[n.address] for n in self.nodes]
                if time.monotonic() > deadline:
                    raise ConfigError(f"nodes did not all register in etcd: {sorted(by_address)}")
                time.sleep(0.1)

    def fault(self, kind: str, index: int) -> None:
        """`kind` (kill, blackhole) on node `index`; a kill returns once the process is gone.

        Raises:
            ConfigError: an unknown fault or node.
        """
        if kind not in FAULTS or not 0 <= index < len(self.nodes):
            raise ConfigError(f"no fault {kind!r} on node {index} (faults: {', '.join(FAULTS)})")
        node = self.nodes[index]
        if kind == "kill":
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(30)
        else:
            node.host.blackhole()
        self.faults.append({"fault": kind, "node": index, "node_id": self.node_ids[index]})

    def describe(self) -> dict[str, object]:
        return {
            "nodes": [{"id": i, "address": n.address, "netns": n.host.netns}
                      for i, n in zip(self.node_ids, self.nodes, strict=True)],
            "dram_per_node": self.dram,
            "lease_ttl_s": self.lease_ttl_s,
            "faults": self.faults,
        }  # fmt: skip

    def close(self) -> None:
        """Stop everything (errors ignored: this runs after failures too). A Ctrl-C or SIGTERM
        that arrives meanwhile is held until everything is removed, then raised: a second
        Ctrl-C must not leave namespaces, a bridge or processes behind."""
        if threading.current_thread() is not threading.main_thread():
            self._close()  # signal handlers run only on the main thread anyway
            return
        held: list[int] = []
        previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
        try:
            self._close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if held:
            raise KeyboardInterrupt

    def _close(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGKILL)  # a blackholed node cannot leave cleanly
                node.proc.wait(30)
        self.nodes.clear()
        if self._etcd is not None:
            self._etcd.stop()
        if self._net is not None:
            self._net.close()  # kills whatever still runs in the namespaces
        if self._scratch is not None:
            self._scratch.cleanup()
