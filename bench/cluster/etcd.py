"""A real etcd for cluster benchmarks and tests: its command line, a health check, and a
one-member server that `bench trace --live cluster` starts and stops (the tests' `EtcdServer`
adds TLS, auth and restarts on top of the same pieces)."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

from kvoffload.bench.common import free_port, stop_process
from kvoffload.errors import ConfigError

__all__ = ["Etcd", "etcd_argv", "etcd_healthy"]


def etcd_argv(binary: str, name: str, data_dir: Path, client_url: str, peer_url: str) -> list[str]:
    """A one-member etcd serving clients at `client_url`, data in `data_dir`."""
    return [
        binary, "--name", name, "--data-dir", str(data_dir),
        "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"{name}={peer_url}", "--log-level", "warn",
    ]  # fmt: skip


def etcd_healthy(base: str, context: ssl.SSLContext | None = None) -> bool:
    """Whether etcd at `base` (http[s]://host:port) says it is healthy."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=1, context=context) as resp:
            return bool(json.load(resp).get("health") == "true")
    except (OSError, ValueError):
        return False


class Etcd:
    """One plain etcd member on `host` (random ports), data and log under `directory`."""

    def __init__(self, directory: Path, host: str = "127.0.0.1") -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise ConfigError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.binary, self.directory, self.host = binary, directory, host
        self.port = free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 30) -> None:
        """Start it and wait until it is healthy.

        Raises:
            ConfigError: it exited or stayed unhealthy for `timeout_s` (with its log's end).
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        log = self.directory / "etcd.log"
        peer = f"http://{self.host}:{free_port(self.host)}"
        argv = etcd_argv(
            self.binary, "kvbench", self.directory / "data", f"http://{self.endpoint}", peer
        )
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not etcd_healthy(f"http://{self.endpoint}"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"etcd did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc, 10)
        self.proc = None
