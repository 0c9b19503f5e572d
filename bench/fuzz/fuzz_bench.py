"""`kvoffload bench fuzz`: mutated native frames and NVMe/TCP PDUs at a live daemon, while one
good client does put/get round trips and measures what the fuzz costs it.

Fuzz workers run in their own processes (so they do not share the good client's interpreter)
and send, from many connections, valid frames mutated in the ways a broken or hostile peer
would: flipped bytes, huge or off-by-one length fields, truncation, random garbage, msgpack
headers of the wrong shape, valid NVMe capsules with random fields, plus a slow worker
(a valid put header, then its payload a byte at a time) and a worker that opens many
connections and leaves them half-open. Every worker stops at its share of `--frames` or at
`--seconds`, whichever comes first.

Rows: frames sent; the daemon's RSS before the fuzz and its peak during it (VmHWM from
/proc/<pid>/status, reset before the fuzz); the good client's p50/p99/max round trip during the
fuzz against the same measured in the same run before it; the longest stall (the longest wait
for one round trip); and how many round trips failed or read wrong bytes. Goals (from the
reliability issue): RSS peak <= baseline + 256 MiB with default limits, p99 <= 3x baseline, no
stall over 1 s.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.bench.common import BenchResult, Row, daemon_ports, stop_process
from kvoffload.bench.fuzz.load import WORKERS, Job, work
from kvoffload.client_sdk import Client
from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.kvstore import parse_size

__all__ = ["HELP", "FuzzReport", "add_arguments", "daemon", "fuzz", "run", "run_from_args"]

HELP = "mutated native frames and NVMe/TCP PDUs at a live daemon; a good client's latency"

_GOOD_KEYS = 32
# Between the good client's round trips: it measures, it does not compete for the CPU.
_GOOD_PACE = 0.002
_BASELINE_TRIPS = 500
_WARMUP_TRIPS = 50  # not counted: first connections, first allocations
# Address space the daemon may use beyond its DRAM tier (its baseline is ~0.4 GiB).
_DAEMON_ADDRESS_SPACE = 2 << 30


@dataclass
class FuzzReport:
    """What one fuzz run measured; latencies in seconds, sizes in bytes."""

    frames: int = 0
    connections: int = 0
    seconds: float = 0.0
    by_worker: dict[str, int] = field(default_factory=dict)
    rss_baseline: int | None = None
    rss_peak: int | None = None
    baseline: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)
    longest_stall: float = 0.0
    good_errors: list[str] = field(default_factory=list)
    wrong_values: int = 0
    misses: int = 0


# ---------------------------------------------------------------------------- the daemon


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    ports: dict[str, int]
    stderr_path: Path

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


@contextlib.contextmanager
def daemon(
    flags: Sequence[str] = (),
    *,
    dram: str = "256MiB",
    config: str = "",
    address_space: int = _DAEMON_ADDRESS_SPACE,
) -> Iterator[Daemon]:
    """A `kvoffload serve` on 127.0.0.1 with free ports, `config` (TOML text) and `flags`
    (last: they win). Its stderr goes to a file (a pipe nobody reads would stall a daemon that
    logs a lot). It runs under RLIMIT_AS of its DRAM tier plus `address_space`, so that an
    allocation a fuzzed field sized fails inside it (MemoryError) instead of taking the
    machine's memory."""
    limit = parse_size(dram) + address_space

    with tempfile.TemporaryDirectory(prefix="kvoffload-fuzz-") as tmp:
        args = [sys.executable, "-m", "kvoffload.cli", "serve", "--port", "0"]
        args += ["--nvme-port", "0", "--metrics-port", "0", "--dram", dram, "--ssd", "0"]
        if config:
            (Path(tmp) / "kvoffload.toml").write_text(config)
            args += ["--config", str(Path(tmp) / "kvoffload.toml")]
        args += ["--data-dir", str(Path(tmp) / "data"), *flags]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
        err = Path(tmp) / "stderr"
        with err.open("w") as err_file:
            proc = subprocess.Popen(
                args,
                stdout=subprocess.PIPE,
                stderr=err_file,
                text=True,
                env=env,
            )
        # Set from here (Linux prlimit), not in a preexec_fn: this process may run threads.
        resource.prlimit(proc.pid, resource.RLIMIT_AS, (limit, limit))
        try:
            ports = daemon_ports(proc, err)
            yield Daemon(proc, ports, err)
        finally:
            stop_process(proc)


def _status(pid: int, field_name: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, our own process); False if we cannot."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------- the good client


def _round_trips(
    client: Client,
    rng: random.Random,
    report: FuzzReport,
    out: list[float],
    until: Callable[[], bool],
) -> None:
    """Put then get (bit-exact) until `until()`; each round trip's seconds go to `out`."""
    keys = [rng.randbytes(16) for _ in range(_GOOD_KEYS)]
    while not until():
        time.sleep(_GOOD_PACE)
        key = rng.choice(keys)
        value = rng.randbytes(rng.choice((4096, 65536)))
        t0 = time.perf_counter()
        try:
            client.put(key, value)
            back = client.get(key)
        except KVOffloadError as exc:
            report.good_errors.append(f"{type(exc).__name__}: {exc}")
            back = value
        out.append(time.perf_counter() - t0)
        if back is None:
            report.misses += 1  # evicted by fuzz puts: allowed, not wrong
        elif back != value:
            report.wrong_values += 1


def _jobs(
    kinds: Sequence[str],
    workers: int,
    frames: int,
    deadline: float,
    seed: int,
    limits: tuple[int, int],
    native_port: int,
    nvme_port: int | None,
) -> list[Job]:
    """The fuzz workers' jobs: how many processes of each kind, and each one's share of
    `frames`."""
    # Most frames go to the workers that send many small ones; the slow and crowd workers
    # count their connections' frames too (a few, each held a while).
    procs = {
        "native": max(1, workers // 2),
        "nvme": max(1, workers // 4),
        "slow": 1,
        "crowd": 1,
    }
    shares = {"native": 30, "nvme": 20, "slow": 1, "crowd": 1}
    weight = sum(shares[k] for k in kinds)
    return [
        Job(
            kind,
            "127.0.0.1",
            native_port,
            max(1, frames * shares[kind] // weight // procs[kind]),
            deadline,
            seed * 1000 + len(kinds) * i + j,
            limits,
            nvme_port or 0,
        )
        for j, kind in enumerate(kinds)
        for i in range(procs[kind])
    ]


def fuzz(
    native_port: int,
    nvme_port: int | None,
    *,
    frames: int,
    seconds: float,
    workers: int = 4,
    pid: int | None = None,
    seed: int = 0,
    limits: tuple[int, int] = (4 << 20, 256 << 20),
    kinds: Sequence[str] = ("native", "nvme", "slow", "crowd"),
) -> FuzzReport:
    """Fuzz a daemon listening on 127.0.0.1; `pid` (its process) enables the RSS rows."""
    report = FuzzReport()
    rng = random.Random(seed)
    kinds = [k for k in kinds if k != "nvme" or nvme_port]
    with Client.connect(f"kv://127.0.0.1:{native_port}") as client:
        done = iter(range(_BASELINE_TRIPS + _WARMUP_TRIPS))
        _round_trips(client, rng, report, report.baseline, lambda: next(done, None) is None)
        del report.baseline[:_WARMUP_TRIPS]
        if pid is not None:
            report.rss_baseline = _status(pid, "VmRSS")
            reset = _reset_peak(pid)
        stop = threading.Event()
        sampled = [report.rss_baseline or 0]

        def sample() -> None:
            while pid is not None and not stop.wait(0.05):
                sampled.append(_status(pid, "VmRSS") or 0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        good = threading.Thread(
            target=_round_trips, args=(client, rng, report, report.during, stop.is_set)
        )
        t0 = time.time()
        jobs = _jobs(kinds, workers, frames, t0 + seconds, seed, limits, native_port, nvme_port)
        good.start()
        ctx = multiprocessing.get_context("spawn")
        try:
            with ctx.Pool(len(jobs)) as pool:
                results = pool.map_async(work, jobs).get(seconds + 120)
        finally:
            stop.set()
            good.join()
            sampler.join()
        report.seconds = time.time() - t0
        for kind, sent, conns in results:
            report.frames += sent
            report.connections += conns
            report.by_worker[kind] = report.by_worker.get(kind, 0) + sent
        if pid is not None:
            hwm = _status(pid, "VmHWM") if reset else None
            report.rss_peak = max(hwm or 0, *sampled)
    report.longest_stall = max(report.during, default=0.0)
    return report


# ---------------------------------------------------------------------------- the bench


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _deepest(stderr: str) -> str:
    """The innermost frame and the exception of the first traceback in `stderr`."""
    lines = stderr[stderr.index("Traceback") :].splitlines()[1:]
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if not frames:
        return ""
    end = next((i for i in range(frames[-1] + 1, len(lines)) if not lines[i].startswith(" ")), -1)
    return f"{lines[frames[-1]].strip()}: {lines[end] if end >= 0 else ''}"


def rows(report: FuzzReport) -> list[Row]:
    ms = 1e3
    base, during = report.baseline, report.during
    out = [
        Row("frames_sent", report.frames, "frames", note=f"{report.by_worker}"),
        Row("connections", report.connections, "conns", note=f"in {report.seconds:.1f} s"),
    ]
    if report.rss_baseline is not None and report.rss_peak is not None:
        goal = report.rss_baseline + (256 << 20)
        out.append(Row("rss_baseline", report.rss_baseline, "B"))
        out.append(Row("rss_peak", report.rss_peak, "B", "goal_baseline+256MiB", goal))
    for name, q in (("p50", 50.0), ("p99", 99.0)):
        value, ref = _pct(during, q) * ms, _pct(base, q) * ms
        out.append(Row(f"good_{name}", value, "ms", f"baseline_{name}", ref))
    out.append(
        Row(
            "good_p99_vs_goal",
            _pct(during, 99) * ms,
            "ms",
            "goal_3x_baseline_p99",
            3 * _pct(base, 99) * ms,
        )
    )
    out.append(
        Row(
            "good_max",
            max(during, default=0.0) * ms,
            "ms",
            "baseline_max",
            max(base, default=0.0) * ms,
        )
    )
    out.append(Row("longest_stall", report.longest_stall, "s", "goal", 1.0))
    out.append(Row("good_round_trips", len(during), "trips", note=f"{report.misses} misses"))
    out.append(
        Row(
            "good_errors", len(report.good_errors), "errors", note="; ".join(report.good_errors[:3])
        )
    )
    out.append(Row("good_wrong_values", report.wrong_values, "values"))
    return out


def run(
    *,
    url: str | None = None,
    nvme_port: int | None = None,
    pid: int | None = None,
    frames: int = 50_000,
    seconds: float = 60.0,
    workers: int = 4,
    seed: int = 0,
    kinds: Sequence[str] = tuple(WORKERS),
) -> BenchResult:
    result = BenchResult("fuzz")
    if url is not None:
        m = re.fullmatch(r"kv://127\.0\.0\.1:(\d+)/?", url)
        if m is None:
            raise ConfigError(f"--url must be kv://127.0.0.1:PORT (loopback only), got {url!r}")
        report = fuzz(
            int(m.group(1)),
            nvme_port,
            frames=frames,
            seconds=seconds,
            workers=workers,
            pid=pid,
            seed=seed,
            kinds=kinds,
        )
        stderr = ""
    else:
        with daemon() as d:
            report = fuzz(
                d.ports.get("native", 0),
                d.ports.get("nvme"),
                frames=frames,
                seconds=seconds,
                workers=workers,
                pid=d.proc.pid,
                seed=seed,
                kinds=kinds,
            )
            alive = d.proc.poll() is None
            stderr = d.stderr
        result.notes.append("daemon survived" if alive else "DAEMON DIED")
        if "Traceback" in stderr:
            result.notes.append(
                f"the daemon's stderr has {stderr.count('Traceback')} traceback(s); "
                f"deepest frame of the first: {_deepest(stderr)}"
            )
    result.rows = rows(report)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", help="fuzz this daemon (kv://127.0.0.1:PORT) instead of one started here"
    )
    parser.add_argument(
        "--nvme-port", type=int, help="with --url: its NVMe/TCP port (else no NVMe fuzz)"
    )
    parser.add_argument("--pid", type=int, help="with --url: its process id (for the RSS rows)")
    parser.add_argument("--frames", type=int, default=50_000, help="frames to send in all")
    parser.add_argument("--seconds", type=float, default=60.0, help="stop after this long")
    parser.add_argument("--workers", type=int, default=4, help="fuzz processes (about)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds",
        default=",".join(WORKERS),
        help=f"fuzz workers to run, comma-separated (default all: {','.join(WORKERS)})",
    )


def run_from_args(args: argparse.Namespace) -> BenchResult:
    return run(
        url=args.url,
        nvme_port=args.nvme_port,
        pid=args.pid,
        frames=args.frames,
        seconds=args.seconds,
        workers=args.workers,
        seed=args.seed,
        kinds=args.kinds.split(","),
    )
