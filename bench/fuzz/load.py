"""The fuzz workers of `bench fuzz`: each runs in its own process and sends mutated inputs
from many connections until its quota or deadline."""

import os
import random
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload.bench.fuzz.inputs import (
    KEYS,
    hello_frame,
    mutate_native,
    mutate_nvme,
    native_corpus,
    nvme_corpus,
    nvme_queue,
    with_id,
)
from kvoffload.errors import KVOffloadError
from kvoffload.wire.native import connection as nw
from kvoffload.wire.nvme_tcp import connection as nt

SOCKET_TIMEOUT = 2.0


@dataclass
class Job:
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
        sock.settimeout(SOCKET_TIMEOUT)


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
    except OSError:  # closed by the daemon, or it stopped reading us (flow control)
        return False
    return _drain(sock)


def _connect(job: Job, port: int) -> socket.socket | None:
    try:
        sock = socket.create_connection((job.host, port), timeout=SOCKET_TIMEOUT)
    except OSError:
        time.sleep(0.01)
        return None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _close(sock: socket.socket, rng: random.Random) -> None:
    if rng.random() < 0.3:  # an abrupt reset instead of a clean close
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _native_worker(job: Job) -> tuple[int, int]:
    rng = random.Random(job.seed)
    corpus, hello = native_corpus(), hello_frame()
    sent = conns = 0
    while sent < job.quota and time.time() < job.deadline:
        sock = _connect(job, job.port)
        if sock is None:
            continue
        conns += 1
        first = hello if rng.random() < 0.9 else mutate_native(bytearray(hello), rng, job.limits)
        alive = _send(sock, first)
        sent += 1
        rid = 2
        for _ in range(rng.randint(1, 40)):
            if not alive or sent >= job.quota:
                break
            frame = with_id(rng.choice(corpus), rid)
            rid += 1
            data = mutate_native(frame, rng, job.limits) if rng.random() < 0.3 else bytes(frame)
            alive = _send(sock, data)
            sent += 1
        _close(sock, rng)
    return sent, conns


def _nvme_worker(job: Job) -> tuple[int, int]:
    rng = random.Random(job.seed)
    sent = conns = 0
    while sent < job.quota and time.time() < job.deadline:
        admin = _connect(job, job.nvme_port)
        if admin is None:
            continue
        conns += 1
        socks = [admin]
        try:
            cntlid = nvme_queue(admin, 0, 0xFFFF)
            if cntlid is not None and rng.random() < 0.5:
                io = _connect(job, job.nvme_port)
                if io is not None:
                    conns += 1
                    socks.append(io)
                    if nvme_queue(io, 1, cntlid) is None:
                        socks.pop().close()
        except (OSError, KVOffloadError):
            cntlid = None
        sent += 2
        sock = socks[-1]
        alive = True
        for _ in range(rng.randint(1, 40)):
            if not alive or sent >= job.quota:
                break
            pdu = rng.choice(nvme_corpus(rng))
            alive = _send(sock, mutate_nvme(pdu, rng) if rng.random() < 0.4 else pdu)
            sent += 1
        for s in reversed(socks):
            _close(s, rng)
    return sent, conns


def _slow_worker(job: Job) -> tuple[int, int]:
    """A valid put header, then its payload a few bytes at a time, until the daemon cuts the
    connection off (its frame timeout) or the worker's share is sent; several at once."""
    rng = random.Random(job.seed)
    hello = hello_frame()
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
            head = put.send_parts(nw.Put(rid, rng.choice(KEYS), 1 << 20), [bytes(1 << 20)])[0]
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


def _crowd_worker(job: Job) -> tuple[int, int]:
    """Many connections at once, each with half a Hello (or ICReq), held a while, then
    dropped."""
    rng = random.Random(job.seed)
    firsts = {job.port: hello_frame()}
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


WORKERS: dict[str, Callable[[Job], tuple[int, int]]] = {
    "native": _native_worker,
    "nvme": _nvme_worker,
    "slow": _slow_worker,
    "crowd": _crowd_worker,
}


def work(job: Job) -> tuple[str, int, int]:
    sent, conns = WORKERS[job.kind](job)
    return job.kind, sent, conns
