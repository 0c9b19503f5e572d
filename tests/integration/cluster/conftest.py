"""Fixtures of the cluster tests: a real etcd, network namespaces, storage nodes in them."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from etcd_server import EtcdServer

from kvoffload.bench.cluster.netns import Host, Network

CLUSTER = "t1"
# Short leases, so a killed node leaves within seconds; renewed every third of this.
LEASE_TTL_S = 3
_LISTEN = re.compile(r"^kvoffload: (\S+) listening on (\S+):(\d+)$")
_NODE = re.compile(r"^kvoffload: cluster (\S+) node (\S+)$")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd on 127.0.0.1 (random ports, data in tmp_path), stopped after the test."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def network() -> Iterator[Network]:
    """A bridge and namespaces for nodes (loopback, with a notice, where that is impossible)."""
    net = Network.open()
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def cluster_etcd(network: Network, tmp_path: Path) -> Iterator[EtcdServer]:
    """etcd on the bridge's address in the test's namespace, reachable from every node."""
    server = EtcdServer(tmp_path / "etcd", host=network.gateway)
    server.start()
    yield server
    server.stop()


class Node:
    """`kvoffload serve --cluster` in its own namespace; killed when the test ends."""

    def __init__(
        self,
        host: Host,
        data_dir: Path,
        etcd: str,
        env: dict[str, str],
        ssd: str = "0",
        config: Path | None = None,
    ) -> None:
        self.host, self.data_dir = host, data_dir
        port = "7480" if host.netns else "0"  # one namespace each: every node has port 7480
        argv = [
            sys.executable, "-m", "kvoffload.cli", "serve", "--host", host.address,
            "--port", port, "--nvme-port", "0", "--metrics-port", "0", "--dram", "64MiB",
            "--ssd", ssd, "--data-dir", str(data_dir), "--cluster", f"etcd://{etcd}/{CLUSTER}",
        ]  # fmt: skip
        if config is not None:
            argv += ["--config", str(config)]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
        environ.update(
            KVOFFLOAD_NVME__HOST=host.address,
            KVOFFLOAD_METRICS__HOST=host.address,
            KVOFFLOAD_CLUSTER__LEASE_TTL_S=str(LEASE_TTL_S),
        )
        environ.update(env)
        self.proc = subprocess.Popen(
            host.command(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=environ,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.errors: list[str] = []
        self.ports: dict[str, int] = {}
        self.node_id = ""
        threading.Thread(
            target=self._pump, args=(self.proc.stdout, self.lines), daemon=True
        ).start()
        threading.Thread(target=self._collect, daemon=True).start()

    @staticmethod
    def _pump(stream: object, out: queue.Queue[str | None]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            out.put(line.rstrip("\n"))
        out.put(None)

    def _collect(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.errors.append(line)

    def ready(self, timeout: float = 60) -> bool:
        """Wait for "ready" (True) or for the process to end (False)."""
        while True:
            line = self.lines.get(timeout=timeout)
            if line is None:
                return False
            if m := _LISTEN.match(line):
                self.ports[m.group(1)] = int(m.group(3))
            elif m := _NODE.match(line):
                self.node_id = m.group(2)
            elif line == "kvoffload: ready":
                return True

    @property
    def url(self) -> str:
        return f"kv://{self.host.address}:{self.ports['native']}"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def stderr(self) -> str:
        self.proc.wait(30)
        return "".join(self.errors)


StartNode = Callable[..., Node]


@pytest.fixture
def start_node(network: Network, cluster_etcd: EtcdServer, tmp_path: Path) -> Iterator[StartNode]:
    """start_node(host=None, data=None, env={}, ready=True, ssd="0", config=None): a node on a
    new (or the given) host with a new (or the given) data dir (an SSD tier of `ssd` bytes,
    `config` a TOML file)."""
    nodes: list[Node] = []

    def start(
        host: Host | None = None,
        data: Path | None = None,
        env: dict[str, str] | None = None,
        ready: bool = True,
        ssd: str = "0",
        config: Path | None = None,
    ) -> Node:
        host = host or network.add_host()
        data = data or tmp_path / f"node{len(nodes)}"
        node = Node(host, data, cluster_etcd.endpoint, env or {}, ssd, config)
        nodes.append(node)
        if ready and not node.ready():
            raise AssertionError(f"node did not start: {node.stderr()}")
        return node

    yield start
    for node in nodes:
        node.stop()
