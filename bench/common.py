"""What every benchmark shares: result rows, machine description, JSON output, tables, timing."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import kvoffload

__all__ = [
    "cpu_seconds",
    "daemon",
    "daemon_ports",
    "free_port",
    "peer_python",
    "LOWER_IS_BETTER",
    "BenchResult",
    "Row",
    "Summary",
    "machine_info",
    "stop_process",
    "time_best",
    "time_median",
]

# Units where a smaller value is better (times, sizes): their ratio is reference / kvoffload.
LOWER_IS_BETTER = {"s", "ms", "us", "B"}


@dataclass(frozen=True)
class Row:
    """One measurement next to its reference (DESIGN §9).

    `ratio` is kvoffload / reference for rates and reference / kvoffload for times, so above 1
    always means kvoffload is better.
    """

    case: str
    value: float
    unit: str
    ref: str | None = None
    ref_value: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ref_value is None or not self.value or not self.ref_value:
            return None
        if self.unit in LOWER_IS_BETTER:
            return self.ref_value / self.value
        return self.value / self.ref_value

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {k: v for k, v in asdict(self).items() if k != "note" or v}
        out["ratio"] = None if self.ratio is None else round(self.ratio, 3)
        return out


def machine_info() -> dict[str, object]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "kvoffload": kvoffload.__version__,
    }


@dataclass(frozen=True)
class Summary:
    """An optional second, human-oriented table (one line per subject, one column per
    measure), printed after the rows and kept in the JSON as ``summary``."""

    title: str
    columns: list[str]
    lines: list[list[str]]


@dataclass
class BenchResult:
    bench: str
    rows: list[Row] = field(default_factory=list)
    date: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat())
    machine: dict[str, object] = field(default_factory=machine_info)
    notes: list[str] = field(default_factory=list)
    summary: Summary | None = None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "bench": self.bench,
            "date": self.date,
            "machine": self.machine,
            "notes": self.notes,
            "rows": [r.as_dict() for r in self.rows],
        }
        if self.summary is not None:
            out["summary"] = asdict(self.summary)
        return out

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=2) + "\n")

    def print(self, console: Console | None = None) -> None:
        console = console or Console()
        table = Table(
            title=f"kvoffload bench {self.bench}  ({self.machine['cpus']} CPUs, "
            f"{self.machine['cpu'] or platform.machine()})"
        )
        for name in ("case", "kvoffload", "reference", "ref value", "ratio"):
            table.add_column(name, justify="left" if name in ("case", "reference") else "right")
        for r in self.rows:
            ratio = r.ratio
            table.add_row(
                r.case,
                f"{r.value:,.3g} {r.unit}",
                r.ref or "",
                "" if r.ref_value is None else f"{r.ref_value:,.3g} {r.unit}",
                "n/a" if ratio is None else f"{ratio:.2f}x",
            )
        console.print(table)
        if self.summary is not None:
            summary = Table(title=self.summary.title)
            for i, name in enumerate(self.summary.columns):
                summary.add_column(name, justify="left" if i == 0 else "right")
            for line in self.summary.lines:
                summary.add_row(*line)
            console.print(summary)
        for note in self.notes:
            console.print(f"[dim]{note}[/]")


def _samples(fn: Callable[[], object], rounds: int) -> list[float]:
    """Seconds of each of `rounds` calls to `fn`, after one warm-up call."""
    fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def time_median(fn: Callable[[], object], rounds: int) -> float:
    """Median seconds of `rounds` calls to `fn` after one warm-up call."""
    return statistics.median(_samples(fn, rounds))


def time_best(fn: Callable[[], object], rounds: int) -> float:
    """Fewest seconds of `rounds` calls to `fn` after one warm-up call: the speed of a core
    that is not shared, on a machine where other work comes and goes."""
    return min(_samples(fn, rounds))


def peer_python(package: str, named: str | None, env: str) -> str:
    """The Python that has a peer `package`: `named` (a flag), else the environment variable
    `env`, else `.venv-<package>` (as `.ci/engines.sh` builds it) in the current directory or
    the source checkout (not with KVOFFLOAD_IGNORE_PEER_VENVS=1), else this Python."""
    named = named or os.environ.get(env)
    if named:
        return named
    if os.environ.get("KVOFFLOAD_IGNORE_PEER_VENVS") == "1":
        return sys.executable  # .ci/run: the engines' environments are still being built
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        candidate = root / f".venv-{package}" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return sys.executable


def stop_process(
    proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout: float = 30
) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_LISTEN = re.compile(r"^kvoffload: (\S+) listening on (\S+):(\d+)$")


def daemon_ports(proc: subprocess.Popen[str], err: Path) -> dict[str, int]:
    """Read a starting `kvoffload serve`'s stdout up to ``kvoffload: ready``: its listeners'
    ports by name; then keep draining stdout so the daemon never blocks on it.

    Raises:
        RuntimeError: it exited first (with the end of its stderr file `err`).
    """
    ports: dict[str, int] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := _LISTEN.match(line.strip()):
            ports[m.group(1)] = int(m.group(3))
        if line.strip() == "kvoffload: ready":
            break
    else:
        raise RuntimeError(f"kvoffload serve did not start: {err.read_text()[-2000:]}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (for a reference server's flag)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def daemon(dram: str, tmp: str, workers: int = 1) -> Iterator[tuple[str, int]]:
    """A `kvoffload serve` on loopback: (its kv:// URL, its pid)."""
    args = [
        sys.executable,
        "-m",
        "kvoffload.cli",
        "serve",
        "--port",
        "0",
        "--workers",
        str(workers),
    ]
    args += ["--nvme-port", "0", "--metrics-port", "0", "--dram", dram, "--ssd", "0"]
    args += ["--data-dir", tmp]
    # KVOFFLOAD_PURE_PYTHON reaches the daemon: a pure-Python run measures both sides so.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVOFFLOAD_") or k == "KVOFFLOAD_PURE_PYTHON"
    }
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = None
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _LISTEN.match(line.strip())
            if m and m.group(1) == "native":
                port = int(m.group(3))
            if line.strip() == "kvoffload: ready":
                break
        if port is None:
            raise RuntimeError("kvoffload serve did not start")
        yield f"kv://127.0.0.1:{port}", proc.pid
    finally:
        stop_process(proc)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid`, all threads (fields 14 and 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()  # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
