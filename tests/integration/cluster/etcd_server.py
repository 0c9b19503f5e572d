"""A real etcd (Debian's etcd-server, installed by .ci/deps) for the cluster tests."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member on `host`, data in `data_dir`; stop() and start() keep the data."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1") -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.fail("etcd is not installed (bash .ci/deps installs Debian's etcd-server)")
        self.binary, self.data_dir, self.host = binary, data_dir, host
        self.port = free_port(host)
        self.peer_port = free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"{data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        client = f"http://{self.endpoint}"
        peer = f"http://{self.host}:{self.peer_port}"
        args = [
            self.binary, "--name", "kvtest", "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvtest={peer}", "--log-level", "warn",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"etcd did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as resp:
                return bool(json.load(resp).get("health") == "true")
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def keys(self, prefix: bytes) -> dict[bytes, bytes]:
        """The keys under `prefix` and their values (a direct read, for assertions)."""
        import base64

        end = prefix[:-1] + bytes([prefix[-1] + 1])
        body = json.dumps(
            {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()}
        ).encode()
        req = urllib.request.Request(f"http://{self.endpoint}/v3/kv/range", data=body)
        with urllib.request.urlopen(req, timeout=5) as resp:
            answer = json.load(resp)
        return {
            base64.b64decode(kv["key"]): base64.b64decode(kv.get("value", ""))
            for kv in answer.get("kvs", [])
        }

    def put(self, key: bytes, value: bytes) -> None:
        import base64

        body = json.dumps(
            {"key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode()}
        ).encode()
        req = urllib.request.Request(f"http://{self.endpoint}/v3/kv/put", data=body)
        with urllib.request.urlopen(req, timeout=5):
            pass

    def delete(self, key: bytes) -> None:
        import base64

        body = json.dumps({"key": base64.b64encode(key).decode()}).encode()
        req = urllib.request.Request(f"http://{self.endpoint}/v3/kv/deleterange", data=body)
        with urllib.request.urlopen(req, timeout=5):
            pass
