from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Hypothesis: bounded, deterministic-enough runs on a shared 2-core machine.
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("KVOFFLOAD_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")

# ---------------------------------------------------------------------------- daemons
# Real `kvoffload serve` processes on 127.0.0.1 with free ports, for the tests.

_LISTEN = re.compile(r"^kvoffload: (\S+) listening on (\S+):(\d+)$")
_EVENTS = re.compile(r"^kvoffload: events publishing on (\S+)$")


class Daemon:
    """A daemon subprocess; stopped with SIGTERM (by pid) when the test ends."""

    def __init__(
        self,
        tmp: Path,
        *flags: str,
        config: str | None = None,
        env: dict[str, str] | None = None,
        defaults: bool = True,
    ) -> None:
        args = [sys.executable, "-m", "kvoffload.cli", "serve"]
        if defaults:  # the test's own flags come after these, so they win
            args += ["--port", "0", "--nvme-port", "0", "--metrics-port", "0"]
            args += ["--dram", "64MiB", "--ssd", "0"]
            args += ["--data-dir", str(tmp / "data")]
            # Run the suite against multi-worker daemons (a check of the design, not for CI).
            if os.environ.get("KVOFFLOAD_TEST_WORKERS"):
                args += ["--workers", os.environ["KVOFFLOAD_TEST_WORKERS"]]
        args += flags
        if config is not None:
            path = tmp / "kvoffload.toml"
            path.write_text(config)
            args += ["--config", str(path)]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
        environ.update(env or {})
        # Its own process group: a crash test kills a multi-worker daemon's processes at once.
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environ,
            start_new_session=True,
        )
        self.ports: dict[str, int] = {}
        self.events = ""
        self.lines: list[str] = []
        deadline = time.monotonic() + 60
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if m := _LISTEN.match(line):
                self.ports[m.group(1)] = int(m.group(3))
            elif m := _EVENTS.match(line):
                self.events = m.group(1)
            elif line == "kvoffload: ready" or time.monotonic() > deadline:
                break
        if "kvoffload: ready" not in self.lines:
            self.proc.kill()
            raise RuntimeError(f"daemon did not start: {self.lines} {self.proc.stderr.read()}")  # type: ignore[union-attr]
        # Keep draining stdout and stderr so the daemon never blocks on a full pipe.
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()
        self._errors: list[str] = []
        self._drain_err = threading.Thread(target=self._read_errors, daemon=True)
        self._drain_err.start()

    def _read_rest(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _read_errors(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._errors.append(line)

    @property
    def port(self) -> int:
        return self.ports.get("native") or self.ports["native+tls"]

    def url(self, **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"kv://127.0.0.1:{self.port}" + (f"?{query}" if query else "")

    def nvme_url(self, subnqn: str = "nqn.2026-11.io.kvoffload:store", **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        url = f"nvme+tcp://127.0.0.1:{self.ports['nvme']}/{subnqn}"
        return url + (f"?{query}" if query else "")

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._drain.join(timeout=5)
        return self.proc.returncode

    def stderr(self) -> str:
        """What the daemon wrote on stderr (all of it once it has exited)."""
        if self.proc.poll() is not None:
            self._drain_err.join(timeout=10)
        return "".join(self._errors)


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start daemons (each in its own directory); all are stopped when the test ends."""
    started: list[Daemon] = []

    def start(*flags: str, **kwargs: Any) -> Daemon:
        home = tmp_path / f"d{len(started)}"
        home.mkdir()
        daemon = Daemon(home, *flags, **kwargs)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
