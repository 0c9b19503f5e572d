"""LMCache MP mode's L2 tier: kvoffload's `KVOffloadL2Adapter` against LMCache's own `fs`
L2 adapter, both driven by LMCache's own L2 benchmark code (`lmcache bench l2`'s runner: one
producer thread submits `in_flight` tasks of `keys` objects per round, then waits on the
adapter's event fd), on the same disk, in the same run.

Each trial stores a working set through a fresh adapter, closes it, drops the page cache
(``echo 1 > /proc/sys/vm/drop_caches``; a note says when that is not allowed), then loads every
object back through another fresh adapter, so every load reads the disk: kvoffload's from its
SSD tier (O_DIRECT slots; `local://` with a DRAM tier smaller than the working set), LMCache's
from its files. Trials alternate which side goes first; a row is the median of the trials'
round rates (the first round of each phase is a warm-up), and its note gives the CPU seconds
per GB that the benchmark process spent (all its threads; the `kv://` daemon's own CPU is not
in it). The last round's loaded bytes are compared with what was stored.

Runs under a Python that has `lmcache` (``--lmcache-python``, env KVOFFLOAD_LMCACHE_PYTHON,
else `.venv-lmcache`, else this one): ``python -m kvoffload.bench.peers.lmcache_mp --drive JSON``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvoffload.bench.common import BenchResult, Row, daemon_ports, peer_python, stop_process

HELP = "LMCache MP mode: our L2 adapter (local:// SSD, kv://) vs LMCache's fs adapter"

MiB = 1 << 20
_OURS = {
    "type": "plugin",
    "module_path": "kvoffload.connectors.lmcache_mp",
    "class_name": "KVOffloadL2Adapter",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mib", type=int, default=2, help="object size (MiB)")
    parser.add_argument("--keys", type=int, default=8, help="objects per task")
    parser.add_argument("--in-flight", type=int, default=4, help="tasks per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per phase (1st: warm-up)")
    parser.add_argument("--trials", type=int, default=3, help="alternating trials per side")
    parser.add_argument("--dir", help="directory on the disk to measure (default: /var/tmp)")
    parser.add_argument("--no-kv", action="store_true", help="skip the kv:// daemon rows")
    parser.add_argument(
        "--lmcache-python", help="Python with lmcache (env KVOFFLOAD_LMCACHE_PYTHON)"
    )


def run_from_args(args: argparse.Namespace) -> BenchResult:
    return run(
        size=args.size_mib * MiB,
        keys=args.keys,
        in_flight=args.in_flight,
        rounds=args.rounds,
        trials=args.trials,
        root=args.dir,
        kv=not args.no_kv,
        lmcache_python=peer_python("lmcache", args.lmcache_python, "KVOFFLOAD_LMCACHE_PYTHON"),
    )


@contextmanager
def _daemon(home: Path, ssd_bytes: int) -> Iterator[str]:
    """A `kvoffload serve` with a 64 MiB DRAM tier over an SSD tier in `home` (reopened if it
    is there) that keeps every block it evicts (admission after one use)."""
    home.mkdir(exist_ok=True)
    args = [
        sys.executable, "-m", "kvoffload.cli", "serve", "--port", "0", "--nvme-port", "0",
        "--metrics-port", "0", "--dram", "64MiB", "--ssd", f"{ssd_bytes >> 20}MiB",
        "--data-dir", str(home / "data"),
    ]  # fmt: skip
    env = {**os.environ, "KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1"}
    err = home / "stderr"
    with err.open("w") as err_file:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err_file, text=True, env=env)
    try:
        ports = daemon_ports(proc, err)
        yield f"kv://127.0.0.1:{ports['native']}?timeout=60"
    finally:
        stop_process(proc)  # SIGTERM: a clean stop writes its DRAM tier to its SSD tier


def run(
    size: int = 2 * MiB,
    keys: int = 8,
    in_flight: int = 4,
    rounds: int = 4,
    trials: int = 3,
    root: str | None = None,
    kv: bool = True,
    lmcache_python: str | None = None,
) -> BenchResult:
    """Measure, and return the rows (one per operation and kvoffload URL, reference `fs`)."""
    python = lmcache_python or sys.executable
    result = BenchResult("lmcache-mp")
    label = f"{size // MiB}MiB" if size % MiB == 0 else f"{size >> 10}KiB"
    working_set = size * keys * in_flight * rounds
    ssd = working_set + working_set // 2 + 64 * MiB  # slots, journal and slack
    drive = {"size": size, "keys": keys, "in_flight": in_flight, "rounds": rounds}
    base = Path(tempfile.mkdtemp(prefix="kvoffload-lmcache-mp-", dir=root or "/var/tmp"))

    def store_and_load(spec: dict[str, Any]) -> dict[str, Any]:
        stored = _drive(python, {**drive, "spec": spec, "phase": "store"})
        loaded = _drive(python, {**drive, "spec": spec, "phase": "load"})
        return {**{f"store_{k}": v for k, v in stored.items()},
                **{f"load_{k}": v for k, v in loaded.items()}}  # fmt: skip

    def fs(work: Path) -> dict[str, Any]:
        return store_and_load({"type": "fs", "base_path": str(work / "fs")})

    def local(work: Path) -> dict[str, Any]:
        url = (
            f"local://{work / 'kvoffload'}?dram=64MiB&max_value={max(4, 2 * size // MiB)}MiB"
            f"&ssd={ssd >> 20}MiB&admit=1"
        )
        return store_and_load(_ours(url))

    def kv_daemon(work: Path) -> dict[str, Any]:
        # Restarted between the phases, so that no load is served from its DRAM tier.
        with _daemon(work, ssd) as url:
            stored = _drive(python, {**drive, "spec": _ours(url), "phase": "store"})
        with _daemon(work, ssd) as url:
            loaded = _drive(python, {**drive, "spec": _ours(url), "phase": "load"})
        return {**{f"store_{k}": v for k, v in stored.items()},
                **{f"load_{k}": v for k, v in loaded.items()}}  # fmt: skip

    sides = {"fs": fs, "local": local, **({"kv": kv_daemon} if kv else {})}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for trial in range(trials):
            order = list(sides) if trial % 2 == 0 else list(reversed(sides))
            for side in order:
                work = base / f"{side}-{trial}"
                work.mkdir()
                try:
                    runs.setdefault(side, []).append(sides[side](work))
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    _rows(result, runs, label, working_set, trials)
    return result


def _ours(url: str) -> dict[str, Any]:
    return {**_OURS, "adapter_params": {"url": url}}


def _drive(python: str, config: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [python, "-m", "kvoffload.bench.peers.lmcache_mp", "--drive", json.dumps(config)],
        capture_output=True,
        text=True,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"},
        timeout=1800,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def _rows(
    result: BenchResult,
    runs: dict[str, list[dict[str, Any]]],
    label: str,
    working_set: int,
    trials: int,
) -> None:
    failed = {
        side: r[key] for side, rs in runs.items() for r in rs
        for key in ("store_error", "load_error") if key in r
    }  # fmt: skip
    for side, why in failed.items():
        result.notes.append(f"{side}: a phase failed: {why}")

    def median(side: str, key: str) -> float | None:
        values = [r[key] for r in runs.get(side, []) if key in r]
        return statistics.median(values) if values else None

    dropped = all(r.get("load_page_cache_dropped") for rs in runs.values() for r in rs)
    how = "page cache dropped before each load" if dropped else "page cache NOT dropped"
    for op in ("load", "store"):
        ref = median("fs", f"{op}_gbps")
        cases = (("local", f"lmcache_mp_{op}/{label}"), ("kv", f"lmcache_mp_{op}_kv/{label}"))
        for side, case in cases:
            mine = median(side, f"{op}_gbps")
            if mine is None:
                continue
            url = "local:// SSD tier" if side == "local" else "kv:// daemon (SSD tier)"
            cpu = median(side, f"{op}_cpu_s_per_gb") or 0.0
            ref_cpu = median("fs", f"{op}_cpu_s_per_gb") or 0.0
            note = (
                f"{url} vs LMCache 0.5.6 fs adapter, same disk, {how}; median of {trials} "
                f"alternating trials, {working_set >> 20} MiB per trial; CPU s/GB of the "
                f"LMCache process {cpu:.2f} vs {ref_cpu:.2f}"
            )
            result.rows.append(Row(case, mine, "GB/s", "lmcache-fs", ref, note=note))
    for side, rs in runs.items():
        bad = [r for r in rs if not r.get("load_verified")]
        if bad:
            result.notes.append(f"{side}: {len(bad)} load(s) did not return every stored byte")


# ---------------------------------------------------------------------------------- driver


def _drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def drive(config: dict[str, Any]) -> dict[str, Any]:
    """Store (``config["phase"] == "store"``) or load one working set through a fresh adapter
    `config["spec"]` (under a Python with lmcache): the rate in GB/s, CPU seconds per GB, and
    for a load whether the bytes came back."""
    import torch
    from lmcache.cli.commands.bench.l2_adapter_bench.data import (
        create_l1_memory_desc,
        make_aligned_tensor,
        make_memory_objects,
        make_object_keys,
    )
    from lmcache.cli.commands.bench.l2_adapter_bench.runner import bench_load, bench_store
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    size, keys, in_flight, rounds = (config[k] for k in ("size", "keys", "in_flight", "rounds"))
    per_round = keys * in_flight
    buf = make_aligned_tensor(2 * per_round * size, 4096)
    desc = create_l1_memory_desc(buf, align_bytes=4096)
    stores = [make_memory_objects(buf, keys, size, i * keys * size) for i in range(in_flight)]
    loads = [
        make_memory_objects(buf, keys, size, (per_round + i * keys) * size)
        for i in range(in_flight)
    ]
    # Random bytes, the same in the storing and the loading process (seeded): nothing on
    # either side may profit from repeated content.
    g = torch.Generator().manual_seed(1)
    expected = torch.randint(0, 256, (per_round * size,), dtype=torch.uint8, generator=g)
    buf[: per_round * size].copy_(expected)
    spec = argparse.Namespace(l2_adapter=[json.dumps(config["spec"])])
    adapter_config = parse_args_to_l2_adapters_config(spec).adapters[0]

    def round_keys(r: int) -> list[list[Any]]:
        first = r * in_flight * keys
        return [make_object_keys(keys, key_offset=first + i * keys) for i in range(in_flight)]

    op = config["phase"]
    out: dict[str, Any] = {}
    if op == "load":
        out["page_cache_dropped"] = _drop_page_cache()
    adapter = create_l2_adapter(adapter_config, l1_memory_desc=desc)
    try:
        cpu = time.process_time()
        bench = bench_store if op == "store" else bench_load
        objs = stores if op == "store" else loads
        res = bench(adapter, in_flight, keys, size, rounds, round_keys, lambda r: objs, _quiet)
        cpu = time.process_time() - cpu
    finally:
        adapter.close()  # a local:// store writes its DRAM tier to its SSD tier here
    measured = res.round_durations[1:] or res.round_durations
    out["gbps"] = per_round * size / statistics.median(measured) / 1e9
    out["cpu_s_per_gb"] = cpu / (rounds * per_round * size / 1e9)
    out["done"] = sum(res.success_counts)
    if op == "load":  # the last round's objects, compared with what was stored
        out["verified"] = out["done"] == rounds * per_round and all(
            torch.equal(obj.raw_data, expected[i * size : (i + 1) * size])
            for i, obj in enumerate(o for row in loads for o in row)
        )
    return out


def _quiet(message: str) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drive", required=True, help="JSON: spec, size, keys, in_flight, rounds")
    args = parser.parse_args(argv)
    print(json.dumps(drive(json.loads(args.drive))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
