"""A NIXL client may name only its own memory (the trust issue, defect 0; docs/guides/nixl.md,
"What the daemon trusts about a NIXL peer").

The attack: a tenant sends its own genuine NIXL agent metadata with only the 4-byte pid in its
UCX worker address replaced by a bystander's. Over UCX's pid-addressed shared-memory transports
(CMA: process_vm_readv/writev; knem, xpmem) the daemon's process then copies the bystander's
memory itself. The bystander here is plain Python, without NIXL and without any connection to
the daemon; it maps a page at the very address of a page the tenant registered, so that every
check the daemon makes of addresses and registrations passes.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvoffload.client_sdk import Client
from kvoffload.client_sdk.transports.native.nixl_memory import NixlMemory
from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.nvmeof_target.native.agent import daemon_tls
from kvoffload.wire.block import HEADER_BYTES, seal
from kvoffload.wire.native.connection import (
    ErrorReply,
    NixlGet,
    NixlGetResult,
    NixlMemoryDone,
    NixlPut,
    NixlPutDone,
)
from kvoffload.wire.native.connection import NixlMemory as NixlMemoryEvent
from tests.conftest import Daemon
from tests.integration.test_nixl import _HAVE_NIXL, Start, _Raw

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not _HAVE_NIXL and not os.environ.get("KVOFFLOAD_REQUIRE_NIXL"),
        reason="nixl not installed (CI sets KVOFFLOAD_REQUIRE_NIXL=1)",
    ),
]

PAGE = 4096
_PROT_RW = 0x3
_MAP_PRIVATE_ANON = 0x22
_MAP_FIXED_NOREPLACE = 0x100000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

# The bystander: maps one page at the address given, fills it with the secret, prints its pid
# and the address, then answers each line on stdin with its page in hex (until stdin closes).
_BYSTANDER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
addr, secret = int(sys.argv[1]), bytes.fromhex(sys.argv[2])
got = libc.mmap(addr, len(secret), 0x3, 0x22 | 0x100000, -1, 0)
if got != addr:
    print("nomap", flush=True)
    sys.exit(1)
ctypes.memmove(addr, secret, len(secret))
print(os.getpid(), addr, flush=True)
for _ in sys.stdin:
    print(ctypes.string_at(addr, len(secret)).hex(), flush=True)
"""


class _Bystander:
    def __init__(self, addr: int, secret: bytes) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BYSTANDER, str(addr), secret.hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert len(line) == 2 and int(line[1]) == addr, f"bystander could not map: {line}"
        self.pid = int(line[0])

    def memory(self) -> bytes:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return bytes.fromhex(self.proc.stdout.readline().strip())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=20)


@pytest.fixture
def page() -> Iterator[np.ndarray]:
    """One page of the tenant's own (this process's) memory, at an address the kernel picks."""
    addr = _libc.mmap(None, PAGE, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        yield np.ctypeslib.as_array((ctypes.c_uint8 * PAGE).from_address(addr))
    finally:
        _libc.munmap(addr, PAGE)


def _forgeries(metadata: bytes, pid: int) -> list[bytes]:
    """The tenant's genuine metadata with only its pid (in UCX's CMA address) replaced: one
    forgery per place this process's pid occurs, since other 4 bytes (a length, a pointer's low
    half) can equal it by chance and which one is the address's is not ours to know."""
    mine, theirs = os.getpid().to_bytes(4, "little"), pid.to_bytes(4, "little")
    places = [i for i in range(len(metadata) - 3) if metadata[i : i + 4] == mine]
    assert places, "this process's pid is not in its NIXL metadata"
    return [metadata[:i] + theirs + metadata[i + 4 :] for i in places]


def test_a_forged_pid_reaches_no_other_process(
    start_daemon: Start, page: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The settings docs/guides/nixl.md recommends on one host: shared memory and TCP.
    ucx = {"UCX_TLS": "sm,tcp", "UCX_NET_DEVICES": "lo"}
    for name, setting in ucx.items():
        monkeypatch.setenv(name, setting)
    daemon: Daemon = start_daemon("--dram", "128MiB", env=ucx)
    rng = np.random.default_rng(5)
    secret = rng.bytes(PAGE)
    page[:] = 0x54  # the tenant's own bytes ("T")
    addr = int(page.ctypes.data)
    bystander = _Bystander(addr, secret)
    try:
        attempt = 0
        while True:
            tenant = _Raw(daemon.port)
            try:
                region, _ = tenant.memory.register(memoryview(page))
                assert region == (addr, PAGE)
                forgeries = _forgeries(tenant.memory.metadata(), bystander.pid)
                _attack(daemon, tenant, forgeries[attempt], page, secret, attempt)
                assert bystander.memory() == secret, "the daemon wrote into the bystander's memory"
            finally:
                tenant.close()
            attempt += 1
            if attempt == len(forgeries):
                break
    finally:
        bystander.close()
    assert daemon.proc.poll() is None  # the daemon lives


def _attack(
    daemon: Daemon, tenant: _Raw, forged: bytes, page: np.ndarray, secret: bytes, attempt: int
) -> None:
    """Load the forged metadata, then name the page in a put and in a get."""
    addr = int(page.ctypes.data)
    region = (addr, PAGE)
    loaded = tenant.ask(NixlMemoryEvent(next(tenant.ids), forged, region))
    print("metadata with the bystander's pid:", loaded)

    # A put whose descriptor names the page: must not store the bystander's bytes.
    key = bytes([0x73, attempt]) * 8
    head = seal(key_or_hash=key, payload=secret, stored_length=PAGE, raw_length=PAGE)
    put = tenant.ask(NixlPut(next(tenant.ids), (key,), (head,), (addr,), (PAGE,)))
    print("put:", put)
    stored: bytes | None
    try:
        with Client.connect(daemon.url()) as plain:
            got = plain.get(key)
        stored = None if got is None else bytes(got)
    except KVOffloadError as exc:  # a block whose payload is not the sealed secret
        stored = None
        print("stored block:", exc)
    leaked = stored == secret
    assert not leaked, "the daemon copied the bystander's memory into a block"
    assert isinstance(put, (NixlPutDone, ErrorReply))

    # A get into the page: must not write into the bystander's memory.
    if isinstance(put, NixlPutDone) and isinstance(loaded, NixlMemoryDone):
        other, value = bytes([0x77, attempt]) * 8, np.full(PAGE - HEADER_BYTES, 0x57, np.uint8)
        with Client.connect(daemon.url()) as plain:
            plain.put(other, value)
        got_into = tenant.ask(NixlGet(next(tenant.ids), (other,), (addr,), (PAGE,)))
        print("get:", got_into)
        if isinstance(got_into, NixlGetResult) and got_into.lengths[0] is not None:
            # It landed in the tenant's own page, where the tenant's agent put it.
            assert np.array_equal(page[: value.size], value)


_REFUSED = "sm,shm,mm,cma,knem,xpmem,posix,sysv,self,cuda_ipc,rocm_ipc"


@pytest.mark.parametrize(
    ("operator", "daemon"),
    [
        (None, "^" + _REFUSED),
        ("", "^" + _REFUSED),
        ("all", "^" + _REFUSED),
        ("sm,tcp", "tcp"),
        ("tcp", "tcp"),
        ("rc_x,ud,sm,self,cuda_copy,cuda_ipc", "rc_x,ud,cuda_copy"),
        ("^ib,cma", "^ib,cma," + _REFUSED.replace("cma,", "")),
        (" TCP , CMA ", "TCP"),
    ],
)
def test_the_daemons_transports(operator: str | None, daemon: str) -> None:
    """What the daemon's agent may use, from the operator's UCX_TLS: never a transport that
    reaches memory by an identifier the peer declares."""
    assert daemon_tls(operator) == daemon
    assert daemon_tls(daemon) == daemon  # a second try derives the same


@pytest.mark.parametrize("operator", ["sm", "cma,self", "posix,sysv,xpmem,knem"])
def test_no_transport_left_is_refused(operator: str) -> None:
    with pytest.raises(ConfigError, match="UCX_TLS"):
        daemon_tls(operator)


def test_a_daemon_left_no_transport_says_so(start_daemon: Start) -> None:
    daemon = start_daemon(env={"UCX_TLS": "sm", "UCX_NET_DEVICES": "lo"})
    tenant = _Raw(daemon.port)
    try:
        refusal = tenant.ask(NixlMemoryEvent(next(tenant.ids), tenant.memory.metadata()))
        assert isinstance(refusal, ErrorReply) and "UCX_TLS" in refusal.message, refusal
    finally:
        tenant.close()
    assert daemon.proc.poll() is None


def test_a_client_that_declares_another_agents_worker_is_refused(
    start_daemon: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27 (2): an attacker declares a victim NIXL process's whole metadata (its worker's
    TCP address) with the victim's registered buffer; the daemon sends its nonce to that
    worker, which the attacker cannot read, so no transfer touches the victim's memory."""
    ucx = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    for name, setting in ucx.items():  # read when this process's agents are made
        monkeypatch.setenv(name, setting)
    daemon: Daemon = start_daemon("--dram", "128MiB", env=ucx)
    victim = NixlMemory()  # another UCX process's agent: no connection to the daemon
    secret = np.frombuffer(os.urandom(PAGE), np.uint8).copy()
    original = secret.copy()
    region, _ = victim.register(memoryview(secret))
    attacker = _Raw(daemon.port)
    try:
        declared = attacker.ask(NixlMemoryEvent(next(attacker.ids), victim.metadata(), region))
        assert isinstance(declared, NixlMemoryDone), declared  # a claim the daemon must test
        # The nonce went to the victim's worker, not to the attacker's.
        for _ in range(20_000):
            victim.progress()
            attacker.memory.progress()
            if victim.proofs:
                break
            time.sleep(0.001)
        assert victim.proofs and not attacker.memory.proofs
        # A put that would read the victim's buffer into a block: refused, nothing stored.
        key = b"v" * 16
        head = seal(key_or_hash=key, payload=secret.tobytes(), stored_length=PAGE, raw_length=PAGE)
        put = attacker.ask(NixlPut(next(attacker.ids), (key,), (head,), (region[0],), (PAGE,)))
        assert isinstance(put, ErrorReply) and "not proven" in put.message, put
        with Client.connect(daemon.url()) as plain:
            assert plain.get(key) is None
    finally:
        attacker.close()
    # A guessed echo is refused too, and a get into the victim's buffer never runs.
    guesser = _Raw(daemon.port)
    try:
        assert isinstance(
            guesser.ask(NixlMemoryEvent(next(guesser.ids), victim.metadata(), region)),
            NixlMemoryDone,
        )
        guess = guesser.ask(NixlMemoryEvent(next(guesser.ids), echo=bytes(32)))
        assert isinstance(guess, ErrorReply) and "not this client's" in guess.message, guess
    finally:
        guesser.close()
    with Client.connect(daemon.url()) as plain:
        plain.put(b"w" * 16, np.full(PAGE - HEADER_BYTES, 0x57, np.uint8))
    wrote = _Raw(daemon.port)
    try:
        wrote.ask(NixlMemoryEvent(next(wrote.ids), victim.metadata(), region))
        got = wrote.ask(NixlGet(next(wrote.ids), (b"w" * 16,), (region[0],), (PAGE,)))
        assert isinstance(got, ErrorReply), got
    finally:
        wrote.close()
    assert np.array_equal(secret, original), "the daemon wrote into the victim's memory"
    victim.close()
    # The honest path still works: the SDK proves its own worker.
    with Client.connect(daemon.url(data="nixl")) as client:
        client.put(b"h" * 16, np.full(PAGE, 7, np.uint8))
        out = np.zeros(PAGE, np.uint8)
        assert client.get_into(b"h" * 16, out) == PAGE and (out == 7).all()
    assert daemon.proc.poll() is None
