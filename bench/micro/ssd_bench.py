"""`kvoffload bench ssd`: the SSD tier next to raw O_DIRECT I/O (and fio) on the same file system.

- write/<size>: 8 threads of durable puts (DRAM copy, slot write, group-committed journal
  record; a put returns once data and record are on stable storage), against 8 threads of raw
  O_DIRECT `pwrite` + `fdatasync` of the same sizes, and fio with `--fdatasync=1`.
- read/<size>: 8 threads reading blocks that are only on the SSD (the engine was reopened, so
  DRAM is cold): slot read into DRAM, header and CRC32C check, copy out. Against 8 threads of raw
  O_DIRECT `pread`, and fio.
- ssd_read_nixl/2MiB, ssd_write_nixl/2MiB (and _uring): the same reads and durable writes with
  the slot I/O going through NIXL's POSIX backend (`ssd.io_backend = "nixl-posix"`, Linux AIO
  or io_uring), against the thread path ("posix", ref `threads`), in alternating rounds of one
  run; O_DIRECT on both sides. cpu_us/...: process CPU time per block of the same rounds.
- read_batch/<size> (2MiB, 640KiB, 160KiB: a 70B TP8 block whole and in 4 layer parts): one
  thread, `get_many_into` of 32 cold SSD blocks per call (the SSD-only blocks of a batch are
  read in one io_uring submission, `ssd.io_engine = "io_uring"`), against the same on a ring
  without registered file and memory (`io_uring_plain`), on the read threads (`"threads"`,
  `ssd.read_depth` 8 in flight), NIXL's POSIX backend (where
  installed), read_depth 1 (one block after another), raw O_DIRECT preadv with 8 threads
  (`odirect`) and the same plus one CRC32C pass a block (`odirect_crc`), in alternating
  rounds; cpu_us/read_batch/<size>: process CPU time per block, against each.
- write_durable_<engine>/2MiB (`--write on|only`): 8 threads of durable 2 MiB puts with the slot
  writes through io_uring (`io_uring_plain`: the ring without its registered slot file and
  DRAM memory, `ssd.ring_register = false`) and on the threads, against raw O_DIRECT pwrite
  + fdatasync (`odirect`); demote_<engine>/2MiB: GB/s the background demotion writer moves
  out of a 64 MiB DRAM while one thread puts; alternating rounds of one run. cpu_us/...: CPU
  per block.
- restart/1M: open a store whose index holds 1M blocks, from its checkpoint (after a clean
  close) and from the journal alone (after a crash). index_bytes/1M: bytes of the SSD index's
  arrays per block.
- restart_announce/1M: the same store, every block stored with a vLLM-sized block's metadata
  (16 token ids and the engine's hashes): open it from its checkpoint (what a daemon waits for
  before it serves), then (restart_announce_cpu/1M) list the blocks from the index
  (`Engine.described_table`, no slot read) and publish a `BlockStored` for each (what
  `kvoffload serve` does on a thread once serving, with events on); restart_announce_lock/1M:
  how long the listing holds the engine's lock.
- restart_serve/1M: `kvoffload serve --events` on that store: CPU seconds of the process when
  it prints ready (time until serving), and (restart_serve_announce/1M) of its announce thread.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import mmap
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np

from kvoffload.bench.common import BenchResult, Row
from kvoffload.bench.micro.ssd_restart import serve_rows
from kvoffload.client_sdk import BlockMeta
from kvoffload.errors import ConfigError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.nvmeof_target import EventsConfig, KVEvents

__all__ = ["HELP", "add_arguments", "run", "run_from_args"]

HELP = "SSD tier reads/writes vs raw O_DIRECT and fio; restart time and index bytes at 1M"
SIZES = {"128KiB": 128 << 10, "2MiB": 2 << 20, "8MiB": 8 << 20}
THREADS = 8
PAGE = 4096


def _aligned(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, -(-n // PAGE) * PAGE))


def _parallel(count: int, size: int, work: Callable[[int, memoryview], object],
              cpu: list[float] | None = None) -> float:  # fmt: skip
    """Run work(i, buffer) for i in range(count) on THREADS threads, each with its own
    page-aligned `size`-byte buffer; seconds taken (and the process's CPU seconds meanwhile
    appended to `cpu`)."""
    counter = iter(range(count))
    lock = threading.Lock()
    buffers = [_aligned(size) for _ in range(THREADS)]
    for b in buffers:
        b[:] = os.urandom(len(b))

    def loop(buf: memoryview) -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            work(i, buf)

    threads = [threading.Thread(target=loop, args=(b,)) for b in buffers]
    t0, cpu0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if cpu is not None:
        cpu.append(time.process_time() - cpu0)
    return time.perf_counter() - t0


def _raw(path: Path, size: int, n: int) -> tuple[float, float]:
    """(write GB/s with fdatasync per write, cold read GB/s) of raw O_DIRECT on `path`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, n * size)

        def write(i: int, buf: memoryview) -> None:
            os.pwrite(fd, buf, i * size)
            os.fdatasync(fd)

        w = n * size / _parallel(n, size, write) / 1e9
        r = n * size / _parallel(n, size, lambda i, buf: os.preadv(fd, [buf], i * size)) / 1e9
        return w, r
    finally:
        os.close(fd)


def _fio(directory: Path, size: int, total: int, mode: str) -> float | None:
    if shutil.which("fio") is None:
        return None
    args = ["fio", "--name=kvoffload", f"--directory={directory}", f"--size={total}",
            f"--bs={size}", f"--rw={mode}", "--direct=1", "--ioengine=psync",
            f"--numjobs={THREADS}", "--group_reporting", "--output-format=json"]  # fmt: skip
    if mode == "write":
        args.append("--fdatasync=1")
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=600, check=True)
        job = json.loads(out.stdout)["jobs"][0]
        return float(job["read" if mode == "read" else "write"]["bw_bytes"]) / 1e9
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        return None
    finally:
        for f in directory.glob("kvoffload.*"):
            f.unlink()


def _engine(path: Path, ssd_bytes: int, io: str = "auto", queue: str = "aio",
            depth: int = 8, engine: str = "auto", register: bool = True) -> Engine:  # fmt: skip
    return Engine(
        EngineConfig(
            DramConfig(capacity_bytes=256 << 20, max_value_bytes=9 << 20),
            SsdConfig(
                capacity_bytes=ssd_bytes,
                admission_min_uses=1,
                flush_on_close=False,
                io_backend=io,
                nixl_queue=queue,
                read_depth=depth,
                io_engine=engine,
                ring_register=register,
            ),  # fmt: skip
            data_dir=str(path),
        )
    )


def _tier_rows(directory: Path, label: str, size: int, total: int, result: BenchResult) -> None:
    n = max(THREADS * 2, total // size)
    store = directory / f"store-{label}"
    value = np.frombuffer(os.urandom(size), dtype=np.uint8)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    ssd_bytes = int(n * (size + 2 * PAGE) * 1.3) + (64 << 20)
    with _engine(store, ssd_bytes) as engine:
        seconds = _parallel(n, size, lambda i, _: engine.put(keys[i], value, durable=True))
    write = n * size / seconds / 1e9
    missing = []

    def read(i: int, buf: memoryview) -> None:
        if engine.get_into(keys[i], buf) != size:
            missing.append(i)

    with _engine(store, ssd_bytes) as engine:  # reopened: DRAM is cold
        read_rate = n * size / _parallel(n, size, read) / 1e9
        corrupt = engine.stats().tiers[1].corrupt_blocks
    if missing or corrupt:
        raise RuntimeError(f"{label}: {len(missing)} blocks did not read back ({corrupt} corrupt)")
    shutil.rmtree(store)
    raw_w, raw_r = _raw(directory / "raw.bin", size, n)
    (directory / "raw.bin").unlink()
    fio_w = _fio(directory, size, n * size // THREADS, "write")
    fio_r = _fio(directory, size, n * size // THREADS, "read")
    note = "fio not installed" if shutil.which("fio") is None else ""
    result.rows += [
        Row(f"write/{label}", write, "GB/s", "odirect", raw_w),
        Row(f"write/{label}", write, "GB/s", "fio", fio_w, note=note),
        Row(f"read/{label}", read_rate, "GB/s", "odirect", raw_r),
        Row(f"read/{label}", read_rate, "GB/s", "fio", fio_r, note=note),
    ]


# The arms of the NIXL rows: name -> (ssd.io_backend, ssd.nixl_queue); "threads" is the ref.
_NIXL_ARMS = {"threads": ("posix", "aio"), "nixl": ("nixl-posix", "aio"),
              "nixl_uring": ("nixl-posix", "uring")}  # fmt: skip
# The engine arms of the read_batch rows: name -> (read_depth, ssd.io_backend, ssd.io_engine,
# ssd.ring_register); "io_uring_plain" is the ring without its registered file and memory.
_BATCH_ARMS = {"io_uring": (8, "posix", "io_uring", True), "threads": (8, "posix", "threads", True),
               "serial": (1, "posix", "threads", True), "nixl": (8, "nixl-posix", "threads", True),
               "io_uring_plain": (8, "posix", "io_uring", False)}  # fmt: skip


def _drop_cache(path: Path) -> None:
    """Drop the file's pages from the page cache (the slot file is read with O_DIRECT; this
    covers a file system that refused it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _settle(engine: Engine) -> None:
    """Let a freshly opened engine's one-time work finish before a timed round, which then
    measures the reads of a running store, not its start: the io_uring pool's pin of the DRAM
    arena (on a thread of its own, ~85 ms a GiB), and the garbage collection the open's
    allocations make due (a full pass over the heap, which otherwise falls in the first
    batches: up to ~300 us a block over a 64-block round at 2 MiB)."""
    pages = engine._ssd.io.pages if engine._ssd is not None else None
    pinned = getattr(pages, "pinned", None)
    if isinstance(pinned, threading.Event) and not pinned.wait(120):
        raise RuntimeError("the io_uring ring did not pin the arena within 120 s")
    gc.collect()


def _io_stats(engine: Engine) -> tuple[int, int, int]:
    """(requests, transfers, completion checks) of a NIXL slot I/O backend; zeros otherwise."""
    files = getattr(engine._ssd.io.pages, "files", None) if engine._ssd is not None else None
    if files is None:
        return 0, 0, 0
    st = files.stats()
    return st.requests, st.transfers, st.polls


class _NixlRounds:
    """Alternating rounds of the arms: durable puts into a fresh store, then cold reads of a
    store written once; GB/s, CPU seconds and NIXL's counters per arm."""

    def __init__(self, directory: Path, total: int, arms: dict[str, tuple[str, str]]) -> None:
        self.size = 2 << 20
        self.n = max(THREADS * 2, total // self.size)
        self.dir, self.arms = directory, arms
        self.value = np.frombuffer(os.urandom(self.size), dtype=np.uint8)
        self.keys = [i.to_bytes(16, "little") for i in range(self.n)]
        self.ssd_bytes = int(self.n * (self.size + 2 * PAGE) * 1.3) + (64 << 20)
        self.rate: dict[tuple[str, str], list[float]] = {}
        self.cpu: dict[tuple[str, str], list[float]] = {}
        self.io: dict[tuple[str, str], list[int]] = {}
        self.direct = True
        self.store = directory / "store-nixl-read"
        with _engine(self.store, self.ssd_bytes, "posix") as engine:
            _parallel(
                self.n, self.size, lambda i, _: engine.put(self.keys[i], self.value, durable=True)
            )

    def _record(self, op: str, arm: str, seconds: float, cpu: float, engine: Engine) -> None:
        self.rate.setdefault((op, arm), []).append(self.n * self.size / seconds / 1e9)
        self.cpu.setdefault((op, arm), []).append(cpu)
        counts = self.io.setdefault((op, arm), [0, 0, 0])
        for i, c in enumerate(_io_stats(engine)):
            counts[i] += c

    def write(self, arm: str) -> None:
        store, cpu = self.dir / f"store-nixl-write-{arm}", list[float]()
        with _engine(store, self.ssd_bytes, *self.arms[arm]) as engine:

            def put(i: int, _: memoryview) -> None:
                engine.put(self.keys[i], self.value, durable=True)

            seconds = _parallel(self.n, self.size, put, cpu)
            self._record("write", arm, seconds, cpu[0], engine)
        shutil.rmtree(store)

    def read(self, arm: str) -> None:
        _drop_cache(self.store / "ssd.slots")
        missing, cpu = list[int](), list[float]()
        with _engine(self.store, self.ssd_bytes, *self.arms[arm]) as engine:  # DRAM is cold

            def get(i: int, buf: memoryview) -> None:
                if engine.get_into(self.keys[i], buf) != self.size:
                    missing.append(i)

            seconds = _parallel(self.n, self.size, get, cpu)
            corrupt = engine.stats().tiers[1].corrupt_blocks
            assert engine._ssd is not None
            self.direct &= engine._ssd.slots.direct
            self._record("read", arm, seconds, cpu[0], engine)
        if missing or corrupt:
            raise RuntimeError(f"{arm}: {len(missing)} blocks did not read back, {corrupt} corrupt")

    def rows(self, rounds: int) -> list[Row]:
        out: list[Row] = []
        for op in ("read", "write"):
            ref = statistics.median(self.rate[(op, "threads")])
            ref_cpu = statistics.median(self.cpu[(op, "threads")]) / self.n * 1e6
            for arm in self.arms:
                if arm == "threads":
                    continue
                requests, transfers, polls = self.io[(op, arm)]
                per = max(requests, 1)
                mine, theirs = self.rate[(op, arm)], self.rate[(op, "threads")]
                note = (
                    f"{rounds} alternating rounds (median; rounds {min(mine):.2f}-"
                    f"{max(mine):.2f} vs {min(theirs):.2f}-{max(theirs):.2f} GB/s), {self.n} "
                    f"blocks, {THREADS} in flight, O_DIRECT "
                    f"{'on' if self.direct else 'off (cache dropped)'}; NIXL: "
                    f"{transfers / per:.2f} transfers, {polls / per:.1f} checks per request"
                )
                cpu_us = statistics.median(self.cpu[(op, arm)]) / self.n * 1e6
                case = f"ssd_{op}_{arm}/2MiB"
                rate = statistics.median(self.rate[(op, arm)])
                cpu_note = "process CPU time per block (all threads), same rounds"
                out += [
                    Row(case, rate, "GB/s", "threads", ref, note=note),
                    Row(f"cpu_us/{case}", cpu_us, "us", "threads", ref_cpu, note=cpu_note),
                ]
        return out


def _nixl_rows(directory: Path, total: int, rounds: int, result: BenchResult) -> None:
    """The slot I/O through NIXL next to the thread path (`_NixlRounds`)."""
    if importlib.util.find_spec("nixl") is None:
        note = "NIXL not installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)"
        result.rows += [Row(f"ssd_{op}_nixl/2MiB", 0.0, "GB/s", "threads", None, note=note)
                        for op in ("read", "write")]  # fmt: skip
        return
    bench = _NixlRounds(directory, total, _NIXL_ARMS)
    for r in range(rounds):
        for arm in list(_NIXL_ARMS)[:: 1 if r % 2 == 0 else -1]:
            bench.write(arm)
            bench.read(arm)
    shutil.rmtree(bench.store)
    result.rows += bench.rows(rounds)


BATCH = 32  # keys per get_many_into of the read_batch rows (an LMCache task is 8-32)
# Value sizes of the read_batch rows: a 2 MiB block, and the 640 KiB and 160 KiB of a 70B TP8
# block stored whole and in 4 layer parts (per-read overhead weighs more as values shrink).
BATCH_SIZES = {"2MiB": 2 << 20, "640KiB": 640 << 10, "160KiB": 160 << 10}


def _batch_rows(directory: Path, total: int, rounds: int, result: BenchResult,
                label: str = "2MiB") -> None:  # fmt: skip
    """read_batch/<label>: one thread calls `get_many_into` with BATCH cold SSD blocks at a
    time, with the slot reads through io_uring (one submission a batch; ssd.read_depth 8),
    against the same on the read threads (io_engine "threads", 8 in flight), NIXL's POSIX
    backend where installed, read_depth 1 (one block after another), raw O_DIRECT preadv
    with THREADS reads in flight ("odirect"), and the same plus one CRC32C pass over each
    block ("odirect_crc": the least a verified read can cost), in alternating rounds of one
    run; each round drops the cache and reopens the store."""
    size = BATCH_SIZES[label]
    n = max(2 * BATCH, total // size // BATCH * BATCH)
    store, raw = directory / "store-batch", directory / "raw-batch.bin"
    value = np.frombuffer(os.urandom(size), dtype=np.uint8)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    ssd_bytes = int(n * (size + 2 * PAGE) * 1.3) + (64 << 20)
    with _engine(store, ssd_bytes) as engine:
        _parallel(n, size, lambda i, _: engine.put(keys[i], value, durable=True))
    fd = os.open(raw, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    bufs = [_aligned(size) for _ in range(BATCH)]
    for b in bufs:
        b[:] = value.data  # touched: no page faults inside the measured reads
    rate: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    skipped: list[str] = []
    try:
        os.posix_fallocate(fd, 0, n * size)
        _parallel(n, size, lambda i, buf: os.pwrite(fd, buf, i * size))
        os.fsync(fd)

        def engine_arm(arm: str, timed: bool = True) -> tuple[float, float]:
            depth, backend, io_engine, register = _BATCH_ARMS[arm]
            _drop_cache(store / "ssd.slots")
            with _engine(store, ssd_bytes, backend, depth=depth, engine=io_engine,
                         register=register) as engine:  # fmt: skip
                ran = engine.stats().tiers[1].io_engine
                if ran != (backend if backend != "posix" else io_engine):
                    raise RuntimeError(f"read_batch arm {arm} ran on {ran}")
                if not timed:
                    return 0.0, 0.0
                _settle(engine)
                t0, c0 = time.perf_counter(), time.process_time()
                for first in range(0, n, BATCH):
                    got = engine.get_many_into(keys[first : first + BATCH], bufs)
                    if got != [size] * BATCH:
                        raise RuntimeError(f"read_batch: blocks did not read back: {got}")
                return time.perf_counter() - t0, time.process_time() - c0

        def raw_arm(summed: bool) -> tuple[float, float]:
            _drop_cache(raw)
            spent: list[float] = []

            def read(i: int, buf: memoryview) -> None:
                os.preadv(fd, [buf], i * size)
                if summed:
                    crc32c.crc32c(buf)

            seconds = _parallel(n, size, read, spent)
            return seconds, spent[0]

        arms: dict[str, Callable[[], tuple[float, float]]] = {
            "odirect": lambda: raw_arm(False),
            "odirect_crc": lambda: raw_arm(True),
        }
        for arm in _BATCH_ARMS:
            if arm == "nixl" and importlib.util.find_spec("nixl") is None:
                skipped.append("nixl: not installed")
                continue
            try:
                engine_arm(arm, timed=False)  # whether the arm runs here
            except (ConfigError, RuntimeError) as exc:
                skipped.append(f"{arm}: {exc}")
                continue
            arms[arm] = functools.partial(engine_arm, arm)
        for r in range(rounds):
            for arm in list(arms)[:: 1 if r % 2 == 0 else -1]:
                seconds, spent = arms[arm]()
                rate.setdefault(arm, []).append(n * size / seconds / 1e9)
                cpu.setdefault(arm, []).append(spent / n * 1e6)
    finally:
        os.close(fd)
        raw.unlink(missing_ok=True)
        shutil.rmtree(store, ignore_errors=True)
    med = {arm: statistics.median(v) for arm, v in rate.items()}
    spread = ", ".join(f"{a} {min(v):.2f}-{max(v):.2f}" for a, v in rate.items())
    note = (f"{rounds} alternating rounds (median; GB/s per round: {spread}), {n} blocks, "
            f"get_many_into of {BATCH} per call on one thread, read_depth 8; serial = "
            f"read_depth 1 on threads; odirect = {THREADS} threads of raw preadv, odirect_crc "
            "the same plus one CRC32C pass a block; an engine round is timed once the "
            "arena is pinned and a GC pass has run (_settle)")  # fmt: skip
    note += "".join(f"; skipped {s}" for s in skipped)
    cpu_note = "process CPU time per block (all threads), same rounds"
    cpu_med = {arm: statistics.median(v) for arm, v in cpu.items()}
    ours = "io_uring" if "io_uring" in med else "threads"  # the engine's default where it runs
    result.rows += [
        Row(f"read_batch/{label}", med[ours], "GB/s", ref, med[ref], note=f"{ours}; {note}")
        for ref in ("odirect", "odirect_crc", "io_uring_plain", "threads", "serial", "nixl")
        if ref in med and ref != ours
    ]
    result.rows += [
        Row(f"cpu_us/read_batch/{label}", cpu_med[ours], "us", ref, cpu_med[ref],
            note=f"{ours}; {cpu_note}")
        for ref in ("odirect_crc", "odirect", "io_uring_plain", "threads", "serial", "nixl")
        if ref in cpu_med and ref != ours
    ]  # fmt: skip


# The arms of the write_rounds rows: name -> (ssd.io_engine, ssd.ring_register) ("odirect" is
# the raw reference; "io_uring_plain" the ring without its registered file and memory).
_WRITE_ARMS = {"io_uring": ("io_uring", True), "io_uring_plain": ("io_uring", False),
               "threads": ("threads", True)}  # fmt: skip
WRITE_SIZE = 2 << 20


def _write_rounds(directory: Path, total: int, rounds: int, result: BenchResult) -> None:
    """write_durable/2MiB: THREADS threads of durable 2 MiB puts into a fresh store with the
    slot writes through io_uring and on the threads, against THREADS threads of raw O_DIRECT
    pwrite + fdatasync ("odirect"); demote/2MiB: fast puts into 64 MiB of DRAM (less for a small
    `total`: a quarter of the blocks fit) over the SSD with
    the background demotion writer on, GB/s of blocks demoted (the puts wait only when it falls
    behind). Alternating rounds of one run, so the shared disk's load hits every arm alike."""
    size = WRITE_SIZE
    n = max(THREADS * 2, total // size)
    value = np.frombuffer(os.urandom(size), dtype=np.uint8)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    ssd_bytes = int(n * (size + 2 * PAGE) * 1.3) + (64 << 20)
    rate: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    share: dict[str, list[float]] = {}  # demotions by the background writer, per round
    skipped: list[str] = []

    def durable(arm: str) -> None:
        store, spent = directory / f"store-write-{arm}", list[float]()
        io_engine, register = _WRITE_ARMS[arm]
        with _engine(store, ssd_bytes, engine=io_engine, register=register) as engine:
            if engine.stats().tiers[1].io_engine != io_engine:
                raise RuntimeError(f"write arm {arm} ran on {engine.stats().tiers[1].io_engine}")
            seconds = _parallel(
                n, size, lambda i, _: engine.put(keys[i], value, durable=True), spent
            )
        shutil.rmtree(store)
        rate.setdefault(("write", arm), []).append(n * size / seconds / 1e9)
        cpu.setdefault(("write", arm), []).append(spent[0] / n * 1e6)

    # A quarter of the blocks fit (64 MiB at most): the rest must move down while put.
    dram = max(16 << 20, min(64 << 20, n * size // 4))

    def demote(arm: str) -> None:
        store = directory / f"store-demote-{arm}"
        io_engine, register = _WRITE_ARMS[arm]
        config = EngineConfig(
            DramConfig(capacity_bytes=dram, max_value_bytes=size),
            SsdConfig(capacity_bytes=ssd_bytes, admission_min_uses=1, flush_on_close=False,
                      io_engine=io_engine, ring_register=register),
            data_dir=str(store),
        )  # fmt: skip
        with Engine(config) as engine:
            t0, c0 = time.perf_counter(), time.process_time()
            for key in keys:
                engine.put(key, value)
            seconds, spent = time.perf_counter() - t0, time.process_time() - c0
            stats = engine.stats()
            demoted = stats.tiers[1].demotions
        shutil.rmtree(store)
        # The writer's share: only its demotions go in batches (a put that outruns it
        # writes its own victim, one slot).
        share.setdefault(arm, []).append(stats.demotions_background / max(demoted, 1))
        rate.setdefault(("demote", arm), []).append(demoted * size / seconds / 1e9)
        cpu.setdefault(("demote", arm), []).append(spent / max(demoted, 1) * 1e6)

    def raw() -> None:
        path, spent = directory / "raw-write.bin", list[float]()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            os.posix_fallocate(fd, 0, n * size)

            def write(i: int, buf: memoryview) -> None:
                os.pwrite(fd, buf, i * size)
                os.fdatasync(fd)

            seconds = _parallel(n, size, write, spent)
        finally:
            os.close(fd)
            path.unlink()
        rate.setdefault(("write", "odirect"), []).append(n * size / seconds / 1e9)
        cpu.setdefault(("write", "odirect"), []).append(spent[0] / n * 1e6)

    arms: dict[str, Callable[[], None]] = {"odirect": raw}
    for arm in _WRITE_ARMS:
        try:
            with _engine(directory / "store-probe", 64 << 20, engine=_WRITE_ARMS[arm][0]):
                pass
        except ConfigError as exc:
            skipped.append(f"{arm}: {exc}")
            continue
        finally:
            shutil.rmtree(directory / "store-probe", ignore_errors=True)
        arms[arm] = functools.partial(durable, arm)
        arms[f"demote-{arm}"] = functools.partial(demote, arm)
    for r in range(rounds):
        for name in list(arms)[:: 1 if r % 2 == 0 else -1]:
            arms[name]()
    med = {k: statistics.median(v) for k, v in rate.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    spread = ", ".join(f"{op} {a} {min(v):.2f}-{max(v):.2f}" for (op, a), v in rate.items())
    note = (f"{rounds} alternating rounds (median; GB/s per round: {spread}), {n} blocks of "
            f"2 MiB, {THREADS} threads; odirect = {THREADS} threads of raw O_DIRECT pwrite + "
            "fdatasync")  # fmt: skip
    note += "".join(f"; skipped {s}" for s in skipped)
    note += "; load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()) + " at the end"
    cpu_note = "process CPU time per block (all threads), same rounds"
    for arm in _WRITE_ARMS:
        if ("write", arm) not in med:
            continue
        for ref in ("odirect", *(a for a in _WRITE_ARMS if a != arm)):
            if ("write", ref) in med:
                result.rows += [
                    Row(f"write_durable_{arm}/2MiB", med[("write", arm)], "GB/s", ref,
                        med[("write", ref)], note=note),
                    Row(f"cpu_us/write_durable_{arm}/2MiB", cpu_med[("write", arm)], "us", ref,
                        cpu_med[("write", ref)], note=cpu_note),
                ]  # fmt: skip
        other = [a for a in _WRITE_ARMS if a != arm and ("demote", a) in med]
        result.rows += [
            Row(f"demote_{arm}/2MiB", med[("demote", arm)], "GB/s", ref,
                med[("demote", ref)] if ref != "none" else None,
                note=f"fast puts into {dram >> 20} MiB of DRAM, background demotion writer; GB/s "
                f"demoted, {statistics.median(share[arm]):.0%} of them by the writer (median); "
                + note)
            for ref in other or ["none"]
        ]  # fmt: skip


def _restart_rows(directory: Path, entries: int, result: BenchResult) -> None:
    """Populate an index of `entries` header-only blocks through the tier's own bookkeeping
    (slot payloads are not written: a restart reads checkpoint and journal, not slots)."""
    store = directory / "store-restart"
    config = EngineConfig(
        DramConfig(capacity_bytes=64 << 20, max_value_bytes=64 << 10, prefault=False),
        SsdConfig(capacity_bytes=entries * PAGE + (16 << 20), flush_on_close=False),
        data_dir=str(store),
    )
    engine = Engine(config)
    ssd = engine._ssd
    assert ssd is not None
    rng = np.random.default_rng(0)
    keys = rng.bytes(16 * entries)
    with engine._lock:
        for i in range(entries):
            plan = ssd.plan_write(keys[16 * i : 16 * i + 16], 0, None, "")
            ssd.commit_write(plan)
    assert ssd.journal is not None
    ssd.journal.wait()
    index_bytes = ssd.index.memory_bytes() / len(ssd.index)
    # A crash now: the journal holds every record, there is no checkpoint.
    engine._ssd = None
    ssd.close(checkpoint=False)
    engine.config = EngineConfig(config.dram, data_dir=str(store))  # nothing left to flush
    engine.close()
    seconds = {}
    for name in ("journal", "checkpoint"):  # the first reopen's clean close writes the checkpoint
        t0 = time.perf_counter()
        with Engine(config) as again:
            seconds[name] = time.perf_counter() - t0
            assert again._ssd is not None and len(again._ssd.index) == entries
            loaded = again._ssd.index.memory_bytes() / entries
    shutil.rmtree(store)
    label = f"{entries // 1_000_000}M" if entries >= 1_000_000 else f"{entries // 1000}k"
    result.rows += [
        Row(f"restart/{label}", seconds["checkpoint"], "s", "goal_5s", 5.0,
            note="from the checkpoint (clean shutdown)"),
        Row(f"restart_journal/{label}", seconds["journal"], "s", "goal_5s", 5.0,
            note="journal replay only (after a crash)"),
        Row(f"index_bytes/{label}", max(index_bytes, loaded), "B", "goal_128B", 128.0,
            note="numpy arrays of the SSD index per block"),
    ]  # fmt: skip


def _announce_store(store: Path, entries: int) -> EngineConfig:
    """A store of `entries` header-only blocks, each with a vLLM-sized block's metadata (16
    token ids and the engine's hashes: one META record), closed cleanly (a checkpoint)."""
    config = EngineConfig(
        DramConfig(capacity_bytes=64 << 20, max_value_bytes=64 << 10, prefault=False),
        SsdConfig(capacity_bytes=entries * PAGE + (16 << 20), flush_on_close=False),
        data_dir=str(store),
    )
    rng = np.random.default_rng(1)
    keys = rng.bytes(16 * entries)
    tokens = rng.integers(0, 32_000, size=(entries, 16)).tolist()
    with Engine(config) as engine:
        ssd = engine._ssd
        assert ssd is not None
        with engine._lock:
            for i in range(entries):
                meta = BlockMeta(tuple(tokens[i]), block_hash=i + 1, parent_hash=i or None)
                plan = ssd.plan_write(keys[16 * i : 16 * i + 16], 0, None, "", meta.encode())
                ssd.commit_write(plan)
    return config


def _announce_rows(directory: Path, entries: int, result: BenchResult) -> None:
    """A store of `entries` blocks with metadata, reopened and announced in this process, then
    served by `kvoffload serve` with events on (`serve_rows`)."""
    store = directory / "store-announce"
    config = _announce_store(store, entries)
    # A daemon serves once the engine is open; it announces afterwards, on a thread. CPU
    # seconds of this process (a shared machine inflates them less than wall time).
    events = KVEvents(EventsConfig(enabled=True, endpoint="inproc://kvoffload-bench"))
    t0, c0 = time.perf_counter(), time.process_time()
    with Engine(config) as again:
        opened, opened_wall = time.process_time() - c0, time.perf_counter() - t0
        # What `described_table` does, timed in its two parts: under the lock, and after.
        listing = again.described_listing()
        held, held_wall = time.process_time() - c0, time.perf_counter() - t0
        table = listing.table()
        listed = time.process_time() - c0
        announced = events.announce(table)
        queued = time.process_time() - c0
        events.flush()  # every BlockStored packed and handed to the PUB socket
        total, wall = time.process_time() - c0, time.perf_counter() - t0
    assert announced == entries
    label = f"{entries // 1_000_000}M" if entries >= 1_000_000 else f"{entries // 1000}k"
    result.rows += [
        Row(f"restart_announce/{label}", opened, "s", "goal_5s", 5.0,
            note=f"CPU s until the daemon can serve (engine open; wall {opened_wall:.2f} s); "
            "16 token ids per block"),
        Row(f"restart_announce_cpu/{label}", total - opened, "s", "before", 43.5,
            note=f"CPU s of the announce after serving starts: list {listed - opened:.2f} "
            f"(engine lock held {held - opened:.3f} of it) + decode and encode "
            f"{queued - listed:.2f} + publish {total - queued:.2f}; wall "
            f"{wall - opened_wall:.2f} s; before = 2026-12-01"),
        Row(f"restart_announce_lock/{label}", held_wall - opened_wall, "s", "before", 4.6,
            note="wall s the listing holds the engine lock (requests wait); before = the "
            "2026-12-02 listing's CPU s under the lock"),
    ]  # fmt: skip
    result.rows += serve_rows(store, config.ssd.capacity_bytes, label)
    shutil.rmtree(store)


def run(*, directory: str = ".", size_mib: int = 512, entries: int = 1_000_000,
        sizes: dict[str, int] | None = None, nixl: str = "on", rounds: int = 3,
        batch: str = "on", restart: str = "on", write: str = "off",
        batch_sizes: tuple[str, ...] = tuple(BATCH_SIZES)) -> BenchResult:  # fmt: skip
    """Measure in a scratch folder under `directory` (it must support O_DIRECT). `nixl`: "on"
    (with the NIXL rows), "off", or "only" (just them, `rounds` alternating rounds); `batch`
    the same for the read_batch rows ("only" with `nixl` "off": just those); `restart` the
    same for the restart rows ("only": just those, without the other rows); `write` "on" or
    "only" adds the write_durable and demote rows (io_uring vs threads vs raw, `rounds`
    alternating rounds; "only": just those)."""
    result = BenchResult("ssd")
    work = Path(directory) / f"kvoffload-bench-ssd-{os.getpid()}"
    work.mkdir(parents=True)
    alone = nixl == "only" or batch == "only" or write == "only"
    if restart == "only":
        nixl = batch = "off"
    if write == "only":
        nixl = batch = restart = "off"
    try:
        if write != "off":
            _write_rounds(work, size_mib << 20, rounds, result)
        if not alone and restart != "only":
            for label, size in (sizes or SIZES).items():
                _tier_rows(work, label, size, size_mib << 20, result)
        if batch != "off":
            for label in batch_sizes:
                _batch_rows(work, size_mib << 20, rounds, result, label)
        if nixl != "off" and batch != "only":
            _nixl_rows(work, size_mib << 20, rounds, result)
        if entries and not alone and restart != "off":
            _restart_rows(work, entries, result)
            _announce_rows(work, entries, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if restart != "only":
        result.notes.append(
            f"{size_mib} MiB per size, {THREADS} threads; write = durable put vs "
            "pwrite+fdatasync; read = cold SSD read with verification vs O_DIRECT pread; index "
            "rows inserted through the tier's bookkeeping for the restart case"
        )
    if entries and restart != "off":
        result.notes.append(
            f"restart rows: {entries} index rows inserted through the tier's bookkeeping (no "
            "slot payloads); CPU s of this process or of the daemon's; load average "
            + " ".join(f"{x:.1f}" for x in os.getloadavg())
            + " at the end"
        )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=".", help="where to put the scratch store (O_DIRECT)")
    parser.add_argument("--size", type=int, default=512, metavar="MiB", help="MiB per size")
    parser.add_argument("--entries", type=int, default=1_000_000, help="blocks for restart/index")
    parser.add_argument(
        "--nixl",
        choices=("on", "off", "only"),
        default="on",
        help="rows of slot I/O through NIXL vs the threads (only: just those)",
    )
    parser.add_argument(
        "--batch",
        choices=("on", "off", "only"),
        default="on",
        help="rows of batched cold reads (get_many_into) vs serial and raw O_DIRECT",
    )
    parser.add_argument(
        "--restart",
        choices=("on", "off", "only"),
        default="on",
        help="rows of restarts at --entries blocks: open, announce, a daemon until ready",
    )
    parser.add_argument(
        "--batch-sizes",
        default=",".join(BATCH_SIZES),
        help=f"value sizes of the read_batch rows, of {', '.join(BATCH_SIZES)}",
    )
    parser.add_argument(
        "--write",
        choices=("on", "off", "only"),
        default="off",
        help="rows of durable 2 MiB writes and demotions, io_uring vs threads vs raw O_DIRECT",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (NIXL, batch)")


def run_from_args(args: argparse.Namespace) -> BenchResult:
    labels = tuple(s for s in args.batch_sizes.split(",") if s)
    unknown = [s for s in labels if s not in BATCH_SIZES]
    if unknown:
        raise SystemExit(f"--batch-sizes: unknown {unknown}; choose from {list(BATCH_SIZES)}")
    return run(directory=args.dir, size_mib=args.size, entries=args.entries, nixl=args.nixl,
               rounds=args.rounds, batch=args.batch, restart=args.restart,
               write=args.write, batch_sizes=labels)  # fmt: skip
