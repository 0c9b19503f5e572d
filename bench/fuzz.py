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
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from kvoffload.bench.common import BenchResult, Row, stop_process
from kvoffload.client_sdk import Client
from kvoffload.client_sdk.wire import native as nw
from kvoffload.client_sdk.wire import nvme_cmd as nc
from kvoffload.client_sdk.wire import nvme_data as nd
from kvoffload.client_sdk.wire import nvme_tcp as nt
from kvoffload.client_sdk.wire.frames import FRAME
from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.kvstore.config import parse_size

__all__ = ["HELP", "FuzzReport", "add_arguments", "daemon", "fuzz", "run", "run_from_args"]

HELP = "mutated native frames and NVMe/TCP PDUs at a live daemon; a good client's latency"

SUBNQN = "nqn.2026-11.io.kvoffload:store"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000f022"
CC_ENABLE = (6 << 16) | (4 << 20) | (6 << 4) | 1
_SQSIZE = 7  # 0's based: 8 commands per queue, what a daemon with queue_depth >= 8 admits
_LISTEN = re.compile(r"^kvoffload: (\S+) listening on (\S+):(\d+)$")
_GOOD_KEYS = 32
# Between the good client's round trips: it measures, it does not compete for the CPU.
_GOOD_PACE = 0.002
_BASELINE_TRIPS = 500
_WARMUP_TRIPS = 50  # not counted: first connections, first allocations
_SOCKET_TIMEOUT = 2.0
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
            ports: dict[str, int] = {}
            assert proc.stdout is not None
            for line in proc.stdout:
                if m := _LISTEN.match(line.strip()):
                    ports[m.group(1)] = int(m.group(3))
                if line.strip() == "kvoffload: ready":
                    break
            else:
                raise RuntimeError(f"kvoffload serve did not start: {err.read_text()[-2000:]}")
            # Keep reading stdout so the daemon never blocks on it.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
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


# ---------------------------------------------------------------------------- native frames

_KEYS = [bytes([i]) * 16 for i in range(1, 9)]


def _native_corpus() -> list[bytes]:
    """Valid requests, as a client that said Hello sends them (request ids rewritten later)."""
    conn = nw.NativeConnection(nw.Role.CLIENT)
    conn.send(nw.Hello(1))
    requests: list[tuple[nw.Event, list[bytes]]] = [
        (nw.Put(2, _KEYS[0], 100), [bytes(100)]),
        (nw.Put(3, _KEYS[1], 5000, parent=_KEYS[0]), [os.urandom(5000)]),
        (nw.Get(4, _KEYS[0]), []),
        (nw.GetMany(5, tuple(_KEYS)), []),
        (nw.PutMany(6, tuple(_KEYS[:3]), (10, 20, 30), durable=False), [bytes(60)]),
        (nw.Exists(7, _KEYS[2]), []),
        (nw.Delete(8, _KEYS[3]), []),
        (nw.Lookup(9, tuple(_KEYS)), []),
        (nw.Prefetch(10, tuple(_KEYS)), []),
        (nw.Stats(11), []),
    ]
    return [conn.send(event, payload) for event, payload in requests]


def _hello() -> bytes:
    return nw.NativeConnection(nw.Role.CLIENT).send(nw.Hello(1, client="fuzz"))


def _with_id(frame: bytes, rid: int) -> bytearray:
    out = bytearray(frame)
    struct.pack_into("<I", out, 8, rid)
    return out


def _odd_meta(rng: random.Random) -> object:
    """A msgpack value of the wrong shape for any field."""
    choices: list[Callable[[], object]] = [
        lambda: rng.getrandbits(64),
        lambda: -rng.getrandbits(63),
        lambda: "x" * rng.randint(0, 10000),
        lambda: os.urandom(rng.choice((0, 15, 17, 1000))),
        lambda: [None] * rng.randint(0, 5000),
        lambda: [[]] * rng.randint(0, 5000),
        lambda: {"a": {"b": {"c": []}}},
        lambda: rng.random(),
        lambda: None,
        lambda: True,
    ]
    return rng.choice(choices)()


def _mutate_native(frame: bytearray, rng: random.Random, limits: tuple[int, int]) -> bytes:
    max_header, max_payload = limits
    how = rng.randrange(8)
    if how == 0:  # flip bytes
        for _ in range(rng.randint(1, 8)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
    elif how == 1:  # a header length around the limit, or anything
        value = rng.choice((max_header - 1, max_header, max_header + 1, rng.getrandbits(32)))
        struct.pack_into("<I", frame, 12, value)
    elif how == 2:  # a payload length around the limit, or anything
        value = rng.choice((max_payload, max_payload + 1, rng.getrandbits(64), 1 << 40))
        struct.pack_into("<Q", frame, 16, value)
    elif how == 3:  # truncated (what follows is then misaligned)
        return bytes(frame[: rng.randrange(len(frame))])
    elif how == 4:  # garbage
        return os.urandom(rng.randint(1, 4096))
    elif how == 5:  # a header map of the wrong shape, lengths kept consistent
        meta: dict[str, object] = {
            rng.choice(("key", "keys", "length", "lengths", "parents", "x")): _odd_meta(rng)
        }
        packed: bytes = msgpack.packb(meta, use_bin_type=True)
        head = bytearray(frame[: FRAME.size])
        struct.pack_into("<IQ", head, 12, len(packed), 0)
        return bytes(head) + packed
    elif how == 6:  # unknown type, flags or version
        frame[rng.choice((4, 5, 6, 7))] = rng.randrange(256)
    else:  # a header that declares more than is sent, then the next frame
        struct.pack_into("<I", frame, 12, len(frame) - FRAME.size + rng.randint(1, 64))
    return bytes(frame)


# ---------------------------------------------------------------------------- NVMe/TCP PDUs


def _capsule(cmd: nc.Command, data: bytes = b"") -> bytes:
    hlen = nt.CH.size + nc.SQE.size
    pdo = hlen if data else 0
    return nt.CH.pack(nt.PduType.CAPSULE_CMD, 0, hlen, pdo, hlen + len(data)) + cmd.pack() + data


def _h2c(cid: int, ttag: int, offset: int, data: bytes, last: bool = True) -> bytes:
    head = struct.pack("<HHII4x", cid, ttag, offset, len(data))
    plen = 24 + len(data)
    return nt.CH.pack(nt.PduType.H2C_DATA, 0x04 if last else 0, 24, 24, plen) + head + data


def _nvme_corpus(rng: random.Random) -> list[bytes]:
    cid = rng.randrange(1, 0xFFFF)
    key = rng.choice(_KEYS)
    return [
        _capsule(nc.identify(cid, nd.Cns.CONTROLLER)),
        _capsule(nc.identify(cid, nd.Cns.ACTIVE_NAMESPACES)),
        _capsule(nc.identify(cid, nd.Cns.NAMESPACE, nsid=1, csi=1)),
        _capsule(nc.get_log_page(cid, 2, 512)),
        _capsule(nc.get_features(cid, 7)),
        _capsule(nc.property_get(cid, 0, True)),
        _capsule(nc.keep_alive(cid)),
        _capsule(nc.kv_store(cid, 1, key, 64, in_capsule=True), os.urandom(64)),
        _capsule(nc.kv_store(cid, 1, key, 8192, in_capsule=False)),
        _capsule(nc.kv_retrieve(cid, 1, key, 4096)),
        _capsule(nc.kv_exist(cid, 1, key)),
        _capsule(nc.kv_delete(cid, 1, key)),
        _capsule(nc.kv_list(cid, 1, b"", 4096)),
        _h2c(cid, rng.randrange(0x10000), 0, os.urandom(rng.choice((1, 512, 4096)))),
    ]


def _mutate_nvme(pdu: bytes, rng: random.Random) -> bytes:
    out = bytearray(pdu)
    how = rng.randrange(6)
    if how == 5 and len(out) >= 72:  # huge length fields: SGL length, NUMDL, NUMDU
        offset, bits = rng.choice(((36, 0xFFFF0000), (48, 0xFFFF0000), (52, 0x0000FFFF)))
        struct.pack_into("<I", out, offset, struct.unpack_from("<I", out, offset)[0] | bits)
    elif how == 0:  # flip bytes anywhere
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif how == 1 and len(out) >= 72:  # random command dwords (opcode, NSID, SGL, CDW10..15)
        offset = rng.choice((8, 12, 32, 36, 40, 48, 52, 56, 60, 64, 68))
        struct.pack_into("<I", out, offset, rng.getrandbits(32))
    elif how == 2:  # PLEN / HLEN / PDO
        struct.pack_into("<I", out, 4, rng.choice((0, 7, 1 << 20, rng.getrandbits(32))))
        if rng.random() < 0.5:
            out[rng.choice((2, 3))] = rng.randrange(256)
    elif how == 3:
        return bytes(out[: rng.randrange(len(out))])
    else:
        return os.urandom(rng.randint(1, 2048))
    return bytes(out)


def _nvme_queue(sock: socket.socket, qid: int, cntlid: int) -> int | None:
    """ICReq and Fabrics Connect on a fresh socket; the controller id, or None if refused."""
    host = nt.NvmeTcpConnection(nt.Role.HOST)
    sock.sendall(host.send(nt.ICReq()))
    data = nd.ConnectData(bytes(16), cntlid, SUBNQN, HOSTNQN).pack()
    connect = nc.connect(1, qid, _SQSIZE)
    answered = None
    while answered is None:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        host.receive_data(chunk)
        while (event := host.next_event()) is not nt.NEED_DATA:
            if isinstance(event, nt.ICResp):
                sock.sendall(host.send(nt.CapsuleCmd(connect, len(data)), [data]))
            elif isinstance(event, nt.CapsuleResp):
                answered = event.completion
            elif isinstance(event, nt.ConnectionClosed):
                return None
    if not answered.ok:
        return None
    if qid == 0:  # enable the controller, as a host does before any other command
        sock.sendall(_capsule(nc.property_set(2, 0x14, CC_ENABLE)))
    return answered.dw0 & 0xFFFF


# ---------------------------------------------------------------------------- fuzz workers


@dataclass
class _Job:
    kind: str
    host: str
    port: int
    quota: int
    deadline: float  # time.time() based: comparable across processes
    seed: int
    limits: tuple[int, int]  # the native front's max header / payload bytes (mutation targets)
    nvme_port: int = 0


def _drain(sock: socket.socket) -> bool:
    """Read and drop what the daemon sent; False once it closed the connection."""
    sock.setblocking(False)  # a socket with a timeout would wait for data, flags or not
    try:
        while True:
            if not sock.recv(1 << 20):
                return False
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(_SOCKET_TIMEOUT)


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
    except OSError:  # closed by the daemon, or it stopped reading us (flow control)
        return False
    return _drain(sock)


def _connect(job: _Job, port: int) -> socket.socket | None:
    try:
        sock = socket.create_connection((job.host, port), timeout=_SOCKET_TIMEOUT)
    except OSError:
        time.sleep(0.01)
        return None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _close(sock: socket.socket, rng: random.Random) -> None:
    if rng.random() < 0.3:  # an abrupt reset instead of a clean close
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _native_worker(job: _Job) -> tuple[int, int]:
    rng = random.Random(job.seed)
    corpus, hello = _native_corpus(), _hello()
    sent = conns = 0
    while sent < job.quota and time.time() < job.deadline:
        sock = _connect(job, job.port)
        if sock is None:
            continue
        conns += 1
        first = hello if rng.random() < 0.9 else _mutate_native(bytearray(hello), rng, job.limits)
        alive = _send(sock, first)
        sent += 1
        rid = 2
        for _ in range(rng.randint(1, 40)):
            if not alive or sent >= job.quota:
                break
            frame = _with_id(rng.choice(corpus), rid)
            rid += 1
            data = _mutate_native(frame, rng, job.limits) if rng.random() < 0.3 else bytes(frame)
            alive = _send(sock, data)
            sent += 1
        _close(sock, rng)
    return sent, conns


def _nvme_worker(job: _Job) -> tuple[int, int]:
    rng = random.Random(job.seed)
    sent = conns = 0
    while sent < job.quota and time.time() < job.deadline:
        admin = _connect(job, job.nvme_port)
        if admin is None:
            continue
        conns += 1
        socks = [admin]
        try:
            cntlid = _nvme_queue(admin, 0, 0xFFFF)
            if cntlid is not None and rng.random() < 0.5:
                io = _connect(job, job.nvme_port)
                if io is not None:
                    conns += 1
                    socks.append(io)
                    if _nvme_queue(io, 1, cntlid) is None:
                        socks.pop().close()
        except (OSError, KVOffloadError):
            cntlid = None
        sent += 2
        sock = socks[-1]
        alive = True
        for _ in range(rng.randint(1, 40)):
            if not alive or sent >= job.quota:
                break
            pdu = rng.choice(_nvme_corpus(rng))
            alive = _send(sock, _mutate_nvme(pdu, rng) if rng.random() < 0.4 else pdu)
            sent += 1
        for s in reversed(socks):
            _close(s, rng)
    return sent, conns


def _slow_worker(job: _Job) -> tuple[int, int]:
    """A valid put header, then its payload a few bytes at a time, until the daemon cuts the
    connection off (its frame timeout) or the worker's share is sent; several at once."""
    rng = random.Random(job.seed)
    hello = _hello()
    sent = conns = 0
    while sent < job.quota and time.time() < job.deadline:
        socks: list[socket.socket] = []
        for rid in range(2, 6):
            sock = _connect(job, job.port)
            if sock is None:
                continue
            conns += 1
            put = nw.NativeConnection(nw.Role.CLIENT)
            put.send(nw.Hello(1))
            head = put.send_parts(nw.Put(rid, rng.choice(_KEYS), 1 << 20), [bytes(1 << 20)])[0]
            if _send(sock, hello + bytes(head)):
                socks.append(sock)
            sent += 2
        # Each trickled piece counts as a frame sent (a piece of one).
        while socks and sent < job.quota and time.time() < job.deadline:
            for sock in list(socks):
                sent += 1
                if not _send(sock, os.urandom(rng.randint(1, 16))):
                    socks.remove(sock)
                    sock.close()
            time.sleep(0.05)
        for sock in socks:
            sock.close()
    return sent, conns


def _crowd_worker(job: _Job) -> tuple[int, int]:
    """Many connections at once, each with half a Hello (or ICReq), held a while, then
    dropped."""
    rng = random.Random(job.seed)
    firsts = {job.port: _hello()}
    if job.nvme_port:
        firsts[job.nvme_port] = nt.NvmeTcpConnection(nt.Role.HOST).send(nt.ICReq())
    sent = conns = 0
    while sent < job.quota and time.time() < job.deadline:
        socks = []
        for _ in range(min(64, job.quota - sent)):
            port = rng.choice(list(firsts))
            sock = _connect(job, port)
            if sock is None:
                break
            conns += 1
            _send(sock, firsts[port][: rng.randrange(1, len(firsts[port]))])
            socks.append(sock)
            sent += 1
        time.sleep(min(0.2, max(0.0, job.deadline - time.time())))
        for sock in socks:
            _close(sock, rng)
        # Rest between crowds: a daemon with few connection slots must also see the others.
        time.sleep(min(0.5, max(0.0, job.deadline - time.time())))
    return sent, conns


_WORKERS: dict[str, Callable[[_Job], tuple[int, int]]] = {
    "native": _native_worker,
    "nvme": _nvme_worker,
    "slow": _slow_worker,
    "crowd": _crowd_worker,
}


def _work(job: _Job) -> tuple[str, int, int]:
    sent, conns = _WORKERS[job.kind](job)
    return job.kind, sent, conns


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
        deadline = t0 + seconds
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
        jobs = [
            _Job(
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
        good.start()
        ctx = multiprocessing.get_context("spawn")
        try:
            with ctx.Pool(len(jobs)) as pool:
                results = pool.map_async(_work, jobs).get(seconds + 120)
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
    kinds: Sequence[str] = tuple(_WORKERS),
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
        default=",".join(_WORKERS),
        help=f"fuzz workers to run, comma-separated (default all: {','.join(_WORKERS)})",
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
