"""`kvoffload bench engine`: DRAM-tier put / get / get_into throughput next to memcpy.

The SDK cases run twice: with the CRC32C header and with the keyed seal (keyed BLAKE3 over
header and payload, `SealKeys`); `seal_cost/...` rows put the sealed rate next to the CRC32C
one, so the ratio is what turning the seal on costs.

The reference is a numpy copy (memcpy) with the same access pattern as the engine case, in the
same run: for put, one source into rotating destinations spread over a region as large as the
engine's working set; for get_into, rotating sources into one destination. Both regions are
pre-faulted, so neither side pays for first-touch page faults.

`--demote on|only` adds rows of readers during a write burst on a store with an SSD tier (in
`--dir`): demote_read_p50/p99 is the latency of one reader's `get_into` of blocks spread over
DRAM and the SSD (an SSD hit needs DRAM room) while another thread puts a burst twice the DRAM
tier's size, with the background demotion writer (`dram.demote_background`, the default)
against demotion on the requests' own threads (ref `inline`), in alternating rounds;
demote_burst is the burst's put rate in the same rounds. Twice: the burst as fast as it goes
(it outruns the disk: both sides wait on it) and paced at `DEMOTE_PACE` (the disk keeps up:
the case the writer is for).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvoffload.bench.common import BenchResult, Row, time_median
from kvoffload.client_sdk import Client, LocalTransport, SealKeys
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig

__all__ = ["HELP", "SIZES", "add_arguments", "run", "run_from_args"]

HELP = "DRAM tier put/get/get_into vs memcpy"

SIZES = {"64KiB": 64 << 10, "512KiB": 512 << 10, "2MiB": 2 << 20, "8MiB": 8 << 20}


def _region(nbytes: int) -> np.ndarray:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0x8000)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=np.uint8)


def _size_rows(
    engine: Engine,
    clients: tuple[Client, Client],
    region: np.ndarray,
    label: str,
    size: int,
    n: int,
    rounds: int,
) -> list[Row]:
    client, sealed = clients
    src = np.frombuffer(os.urandom(size), dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    slots = [region[i * size : (i + 1) * size] for i in range(n)]

    def ref_scatter() -> None:
        for slot in slots:
            slot[:] = src

    def ref_gather() -> None:
        for slot in slots:
            dst[:] = slot

    def get_view(key: bytes) -> None:
        view = engine.get(key)
        if view is not None:
            view.release()

    cases: dict[str, tuple[Callable[[bytes], object], Callable[[], None], str]] = {
        "put": (lambda k: engine.put(k, src), ref_scatter, ""),
        "get": (get_view, ref_gather, "zero-copy pinned view: no bytes move"),
        "get_into": (lambda k: engine.get_into(k, dst), ref_gather, ""),
        "client_put": (lambda k: client.put(k, src), ref_scatter, "SDK: header + CRC32C + copy"),
        "client_get_into": (
            lambda k: client.get_into(k, dst),
            ref_gather,
            "SDK: verify header + CRC32C, then copy",
        ),
        # After the CRC32C cases: these overwrite the same keys with sealed blocks.
        "client_put_sealed": (
            lambda k: sealed.put(k, src),
            ref_scatter,
            "SDK: header + keyed BLAKE3 seal + copy",
        ),
        "client_get_into_sealed": (
            lambda k: sealed.get_into(k, dst),
            ref_gather,
            "SDK: verify header + keyed BLAKE3 seal, then copy",
        ),
    }
    rate = {}
    for ref in (ref_scatter, ref_gather):
        rate[ref] = n * size / time_median(ref, rounds) / 1e9
    rows = []
    for name, (op, ref, note) in cases.items():

        def loop(op: Callable[[bytes], object] = op) -> None:
            for key in keys:
                op(key)

        value = n * size / time_median(loop, rounds) / 1e9
        rows.append(Row(f"{name}/{label}", value, "GB/s", "memcpy", rate[ref], note=note))
    by_case = {row.case: row.value for row in rows}
    for sdk_case in ("client_put", "client_get_into"):
        rows.append(
            Row(
                f"seal_cost/{sdk_case}/{label}",
                by_case[f"{sdk_case}_sealed/{label}"],
                "GB/s",
                "crc32c",
                by_case[f"{sdk_case}/{label}"],
                note="sealed rate / the CRC32C path's rate",
            )
        )
    for key in keys:
        engine.delete(key)
    return rows


def _fill_rows(capacity: int, rounds: int) -> list[Row]:
    """How much of a full DRAM tier holds live values when values have mixed sizes."""
    rng = np.random.default_rng(1)
    lo, hi = 64 << 10, 2 << 20
    src = np.frombuffer(os.urandom(hi), dtype=np.uint8)
    config = DramConfig(capacity_bytes=capacity, max_value_bytes=hi)
    samples = []
    puts = 0
    with Engine(EngineConfig(config)) as engine:
        # Fill it once, then keep putting: each round is one more capacity's worth of puts,
        # sampled at its end (steady state, evicting all the while).
        for round_ in range(rounds + 1):
            written = 0
            while written < capacity:
                size = int(rng.integers(lo, hi + 1))
                engine.put(puts.to_bytes(16, "little"), src[:size])
                written += size
                puts += 1
            if round_:
                samples.append(engine.stats().tiers[0].stored_bytes / capacity)
    fill = float(np.median(samples))
    return [
        Row(
            "dram_fill/mixed",
            fill,
            "ratio",
            "goal_0.85",
            0.85,
            note=f"live bytes / capacity of a full {capacity >> 20} MiB tier, values uniform "
            f"in 64 KiB-2 MiB, median of {rounds} samples (min {min(samples):.3f})",
        )
    ]


DEMOTE_BLOCK = 512 << 10
DEMOTE_PACE = 200e6  # bytes/s of the paced burst: below what the disks we run on write


def _demote_round(
    work: Path, background: bool, dram: int, reads: list[int], burst: int, pace: float
) -> tuple[list[float], float, int]:
    """One round on a fresh store: the reader's get_into latencies (s) during the burst, the
    burst's put rate (bytes/s), and how many requests waited for the writer to make room."""
    store = work / ("bg" if background else "inline")
    shutil.rmtree(store, ignore_errors=True)
    config = EngineConfig(
        DramConfig(capacity_bytes=dram, max_value_bytes=DEMOTE_BLOCK, demote_background=background),
        SsdConfig(capacity_bytes=8 * dram),
        data_dir=str(store),
    )
    value = np.random.default_rng(0).integers(0, 255, DEMOTE_BLOCK, dtype=np.uint8)
    preload = len(set(reads))
    latencies: list[float] = []
    with Engine(config) as engine:
        for i in range(preload):  # 1.5x DRAM: the oldest third is on the SSD only
            engine.put(i.to_bytes(16, "little"), value)
        done = threading.Event()
        elapsed = [0.0]

        def put_burst() -> None:
            t0 = time.perf_counter()
            for n, i in enumerate(range(preload, preload + burst)):
                if pace:  # put n goes no earlier than n blocks at `pace` bytes/s
                    ahead = t0 + n * DEMOTE_BLOCK / pace - time.perf_counter()
                    if ahead > 0:
                        time.sleep(ahead)
                engine.put(i.to_bytes(16, "little"), value)
            elapsed[0] = time.perf_counter() - t0
            done.set()

        buf = np.empty(DEMOTE_BLOCK, dtype=np.uint8)
        writer = threading.Thread(target=put_burst)
        writer.start()
        n = 0
        while not done.is_set():
            key = reads[n % len(reads)].to_bytes(16, "little")
            t0 = time.perf_counter()
            engine.get_into(key, buf)  # a miss (evicted by the burst) counts as a read too
            latencies.append(time.perf_counter() - t0)
            n += 1
        writer.join()
        waits = engine.stats().room_waits
    return latencies, burst * DEMOTE_BLOCK / elapsed[0], waits


def _demote_rows(directory: str, rounds: int, dram: int = 128 << 20) -> list[Row]:
    """Reader latency during a write burst, background writer against inline demotion, with
    the burst unpaced and paced."""
    rows = []
    for pace in (0.0, DEMOTE_PACE):
        rows += _demote_pair(directory, rounds, dram, pace)
    return rows


def _demote_pair(directory: str, rounds: int, dram: int, pace: float) -> list[Row]:
    work = Path(directory) / f"kvoffload-bench-demote-{os.getpid()}"
    work.mkdir(parents=True)
    preload = dram * 3 // 2 // DEMOTE_BLOCK
    reads = [int(k) for k in np.random.default_rng(1).integers(0, preload, 100_000)]
    burst = 2 * dram // DEMOTE_BLOCK
    got: dict[bool, list[tuple[float, float, float, int, int]]] = {True: [], False: []}
    try:
        for _ in range(rounds):
            for background in (False, True):
                lat, rate, waits = _demote_round(work, background, dram, reads, burst, pace)
                q = statistics.quantiles(lat, n=100)
                got[background].append((q[49], q[98], rate, waits, len(lat)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(background: bool, i: int) -> float:
        return statistics.median(r[i] for r in got[background])

    size = f"{DEMOTE_BLOCK >> 10}KiB" + (f"@{pace / 1e6:.0f}MB/s" if pace else "")
    note = (f"{dram >> 20} MiB DRAM, {preload} blocks preloaded, a {burst}-block burst; one "
            f"reader, {med(True, 4):.0f} / {med(False, 4):.0f} reads a round; requests that "
            f"waited for room: {med(True, 3):.0f} a round; median of {rounds} alternating "
            "rounds")  # fmt: skip
    return [
        Row(f"demote_read_p50/{size}", med(True, 0) * 1e6, "us", "inline", med(False, 0) * 1e6,
            note=note),
        Row(f"demote_read_p99/{size}", med(True, 1) * 1e6, "us", "inline", med(False, 1) * 1e6,
            note=note),
        Row(f"demote_burst/{size}", med(True, 2) / 1e9, "GB/s", "inline", med(False, 2) / 1e9,
            note="put rate of the burst in the same rounds"),
    ]  # fmt: skip


def run(
    *,
    working_set: int = 256 << 20,
    rounds: int = 5,
    sizes: dict[str, int] | None = None,
    demote: str = "off",
    directory: str = ".",
) -> BenchResult:
    """Measure each size over `working_set` bytes of distinct blocks; `demote` "on" adds the
    rows of readers during a write burst (a store in `directory`), "only" runs just those."""
    if demote == "only":
        result = BenchResult("engine")
        result.rows += _demote_rows(directory, rounds)
        return result
    sizes = sizes or SIZES
    counts = {label: max(4, working_set // size) for label, size in sizes.items()}
    span = max(counts[label] * size for label, size in sizes.items())
    largest = max(sizes.values())
    config = DramConfig(capacity_bytes=2 * span, max_value_bytes=largest + (64 << 10))
    result = BenchResult("engine")
    region = _region(span)
    with Engine(EngineConfig(config)) as engine:
        client = Client(LocalTransport(engine, owned=False))
        # A fresh random key: the bench measures the cost, not a deployment's key.
        keys = SealKeys([(1, os.urandom(32))])
        sealed = Client(LocalTransport(engine, owned=False), seal=keys)
        for label, size in sizes.items():
            result.rows += _size_rows(
                engine, (client, sealed), region, label, size, counts[label], rounds
            )
    result.rows += _fill_rows(max(working_set, 32 << 20), rounds)
    result.notes.append(
        f"{working_set >> 20} MiB of distinct blocks per size, median of {rounds} rounds; "
        "memcpy = numpy copy with the same access pattern over a pre-faulted region. "
        "get returns a pinned zero-copy view, so its ratio exceeds 1 by design."
    )
    if demote == "on":
        result.rows += _demote_rows(directory, rounds)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--working-set", type=int, default=256, metavar="MiB", help="distinct MiB per size"
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per case (median)")
    parser.add_argument(
        "--demote",
        choices=("on", "off", "only"),
        default="off",
        help="rows of reader latency during a write burst, background demotion vs inline",
    )
    parser.add_argument("--dir", default=".", help="where the --demote rows put their store")


def run_from_args(args: argparse.Namespace) -> BenchResult:
    return run(working_set=args.working_set << 20, rounds=args.rounds, demote=args.demote,
               directory=args.dir)  # fmt: skip
