"""`nvme+tcp://host:4420/<subsystem NQN>`: the NVMe Key Value command set over NVMe/TCP.

A userspace NVMe/TCP host (no kernel modules): one admin queue and several I/O queues, each its
own TCP connection with queue depth > 1, driven through the sans-I/O codec in
`client_sdk/wire/nvme_tcp.py`. Bring-up follows a Linux host's order (ref §1.10) and checks the
controller's answers the way Linux and SPDK do; Keep Alive runs on the admin queue from a
background thread; `close()` shuts the controller down (CC.SHN) before closing the sockets.

`NvmeHost` is the association itself (KV commands by name, any admin command); `NvmeTransport`
adapts it to the SDK's `Transport` protocol with deadlines, retries and reconnects. Blocks are
stored as KV values under their 16-byte block keys; `lookup` pipelines Exist commands.

URL parameters: `hostnqn` (default from /etc/nvme/hostnqn, else one derived from the machine
id), `nsid` (default: the first KV namespace), `queues` (I/O queues, default 4), `depth`
(commands in flight per queue, default 32), `hdgst` / `ddgst` (1: CRC32C header / data
digests), `kato` (keep-alive timeout in ms, default 15000), `timeout` (seconds per operation,
default 30), `connect_timeout` (default 5), `retries` (default 3), `backoff` (default 0.05).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

from kvoffload.client_sdk.transports.base import (
    HeldBlock,
    IntoBuffer,
    PutItem,
    Received,
    received_into,
    received_many_into,
)
from kvoffload.client_sdk.transports.kv import _left, _Retrying, _send_all
from kvoffload.client_sdk.url import StoreURL
from kvoffload.client_sdk.wire import nvme_cmd as nc
from kvoffload.client_sdk.wire import nvme_data as nd
from kvoffload.client_sdk.wire.block import HEADER_BYTES
from kvoffload.client_sdk.wire.nvme_cmd import Command, Completion, Sc, Sct
from kvoffload.client_sdk.wire.nvme_tcp import (
    NEED_DATA,
    R2T,
    C2HData,
    C2HTermReq,
    CapsuleCmd,
    CapsuleResp,
    ConnectionClosed,
    DataEnd,
    H2CData,
    H2CTermReq,
    ICReq,
    ICResp,
    NvmeTcpConnection,
    PduError,
    Role,
    SinkFull,
)
from kvoffload.client_sdk.wire.status import nvme_error_for
from kvoffload.errors import (
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    KVOffloadError,
    LocalProtocolError,
    RemoteProtocolError,
    TransportError,
)

__all__ = ["DEFAULT_SUBNQN", "NvmeHost", "NvmeOptions", "NvmeTransport", "open_nvme"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PORT = 4420
DEFAULT_SUBNQN = "nqn.2026-11.io.kvoffload:store"
_PARAMS = {
    "hostnqn": "this host's NQN (default /etc/nvme/hostnqn or one from the machine id)",
    "nsid": "KV namespace id (default: the first KV namespace)",
    "queues": "I/O queues (default 4)",
    "depth": "commands in flight per queue (default 32)",
    "hdgst": "1 for CRC32C header digests",
    "ddgst": "1 for CRC32C data digests",
    "kato": "keep-alive timeout in ms (default 15000; 0 = none)",
    "timeout": "seconds per operation (default 30)",
    "connect_timeout": "seconds to connect (default 5)",
    "retries": "attempts after a failed one (default 3)",
    "backoff": "first retry delay in seconds (default 0.05)",
}
_ADMIN_DEPTH = 32  # admin queue entries, as Linux asks for
_KV_MISS_SCTS = (Sct.GENERIC, Sct.COMMAND_SPECIFIC)
_CC_CONFIG = (6 << 16) | (4 << 20)  # IOSQES 64 B, IOCQES 16 B, MPS 4 KiB, AMS round robin
_CC_CSS_ALL = 6 << 4  # CC.CSS 110b: every I/O command set the controller supports (KV)
_CC_EN, _CC_SHN_NORMAL = 0x1, 0x1 << 14
_CSTS_RDY, _CSTS_CFS, _CSTS_SHST_MASK, _CSTS_SHST_DONE = 0x1, 0x2, 0xC, 0x8


def _default_host() -> tuple[str, bytes]:
    """(host NQN, host id) like nvme-cli's: /etc/nvme/hostnqn, else from the machine id."""
    with contextlib.suppress(OSError):
        nqn = Path("/etc/nvme/hostnqn").read_text().strip()
        if nqn.startswith("nqn."):
            return nqn, uuid.uuid5(uuid.NAMESPACE_URL, nqn).bytes
    try:
        seed = Path("/etc/machine-id").read_text().strip()
        host = uuid.uuid5(uuid.NAMESPACE_OID, f"kvoffload {seed}")
    except OSError:
        host = uuid.uuid4()
    return f"nqn.2014-08.org.nvmexpress:uuid:{host}", host.bytes


@dataclass(frozen=True)
class NvmeOptions:
    """Where and how to reach an NVMe/TCP KV target (from an `nvme+tcp://` URL)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    subnqn: str = DEFAULT_SUBNQN
    hostnqn: str = ""
    hostid: bytes = b""
    nsid: int = 0
    queues: int = 4
    depth: int = 32
    hdgst: bool = False
    ddgst: bool = False
    kato_ms: int = 15000
    timeout: float = 30.0
    connect_timeout: float = 5.0
    retries: int = 3
    backoff: float = 0.05

    def __post_init__(self) -> None:
        if not self.hostnqn:
            nqn, hostid = _default_host()
            object.__setattr__(self, "hostnqn", nqn)
            object.__setattr__(self, "hostid", self.hostid or hostid)
        if not self.hostid:
            host_uuid = uuid.uuid5(uuid.NAMESPACE_URL, self.hostnqn)
            object.__setattr__(self, "hostid", host_uuid.bytes)
        if not 1 <= self.queues <= 0xFFFE or not 1 <= self.depth <= 1024:
            raise ConfigError("nvme+tcp:// queues must be 1..65534 and depth 1..1024")
        if self.timeout <= 0 or self.connect_timeout <= 0 or self.backoff < 0 or self.retries < 0:
            raise ConfigError("nvme+tcp:// timeouts must be positive, retries and backoff >= 0")
        if not 0 <= self.kato_ms <= 0xFFFF_FFFF or not 0 <= self.nsid < 0xFFFF_FFFF:
            raise ConfigError("nvme+tcp:// kato and nsid must be 32-bit")
        for nqn in (self.subnqn, self.hostnqn):
            try:
                nd.nqn_bytes(nqn)
            except LocalProtocolError as exc:
                raise ConfigError(str(exc)) from None

    @classmethod
    def from_url(cls, url: StoreURL) -> NvmeOptions:
        """Raises: ConfigError: unknown parameter or bad value."""
        params = url.take(_PARAMS)
        kwargs: dict[str, Any] = {"host": url.host or "127.0.0.1", "port": url.port or DEFAULT_PORT}
        subnqn = url.path.lstrip("/")
        if subnqn:
            kwargs["subnqn"] = subnqn
        try:
            for name in ("timeout", "connect_timeout", "backoff"):
                if name in params:
                    kwargs[name] = float(params[name])
            for name, dest in (("queues", "queues"), ("depth", "depth"), ("retries", "retries")):
                if name in params:
                    kwargs[dest] = int(params[name])
            if "nsid" in params:
                kwargs["nsid"] = int(params["nsid"])
            if "kato" in params:
                kwargs["kato_ms"] = int(params["kato"])
        except ValueError as exc:
            raise ConfigError(f"bad nvme+tcp:// parameter: {exc}") from None
        for name in ("hdgst", "ddgst"):
            if name in params:
                if params[name] not in ("0", "1"):
                    raise ConfigError(f"{name} must be 0 or 1, got {params[name]!r}")
                kwargs[name] = params[name] == "1"
        if "hostnqn" in params:
            kwargs["hostnqn"] = params["hostnqn"]
        return cls(**kwargs)

    @property
    def url(self) -> str:
        return f"nvme+tcp://{self.host}:{self.port}/{self.subnqn}"


# ---------------------------------------------------------------------------- commands and calls

# A read sink: (offset in the command's data, bytes still to come in this PDU) -> buffers for
# the next bytes (they may cover fewer), or None to drop the rest of the PDU.
Sink = Callable[[int, int], "list[memoryview] | None"]


@dataclass
class _Cmd:
    """One command a plan wants executed."""

    make: Callable[[int], Command]  # cid -> command
    data: Sequence[memoryview] = ()  # what it writes: in the capsule or on R2T
    sink: Sink | None = None  # where what it reads goes (None: allocated)


@dataclass
class _Call:
    command: Command
    data: Sequence[memoryview] = ()
    sink: Sink | None = None
    completion: Completion | None = None
    chunks: list[memoryview] = field(default_factory=list)  # allocated read data
    received: int = 0
    digest_ok: bool = True
    error: KVOffloadError | None = None
    pos: int = 0  # offset of the next read byte
    left: int = 0  # bytes of the current C2HData still without a sink

    @property
    def done(self) -> bool:
        return self.completion is not None or self.error is not None

    def result(self) -> Completion:
        """The completion (success or not); raises if the call failed in transport."""
        if self.error is not None:
            raise self.error
        assert self.completion is not None
        if not self.digest_ok:  # a data digest failed: the data is not to be trusted
            raise TransportError("data digest mismatch; the command can be retried")
        return self.completion

    def ok(self, what: str) -> Completion:
        """The completion; raises the status's exception unless it succeeded."""
        c = self.result()
        if not c.ok:
            raise nvme_error_for(c.status, what)
        return c

    def check(self, what: str) -> _Call:
        """This call, once `ok` said it succeeded."""
        self.ok(what)
        return self

    def read_data(self) -> memoryview:
        if len(self.chunks) == 1:
            return self.chunks[0]
        return memoryview(b"".join(self.chunks))


Plan = Generator[list[_Cmd], list[_Call], T]


def _one(cmd: _Cmd) -> Generator[list[_Cmd], list[_Call], _Call]:
    (call,) = yield [cmd]
    return call


def _views(parts: Sequence[object]) -> list[memoryview]:
    views = [memoryview(p).cast("B") for p in parts]  # type: ignore[arg-type]
    return [v for v in views if len(v)]


def _cut(views: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """The bytes [start, end) of the concatenation of `views`, as views."""
    out, pos = [], 0
    for view in views:
        lo, hi = max(start, pos), min(end, pos + len(view))
        if lo < hi:
            out.append(view[lo - pos : hi - pos])
        pos += len(view)
        if pos >= end:
            break
    return out


# ---------------------------------------------------------------------------- one queue


class _Queue:
    """One TCP connection, one queue pair; used by one thread at a time."""

    def __init__(self, options: NvmeOptions, qid: int, depth: int, deadline: float) -> None:
        self.options = options
        self.qid = qid
        self.depth = depth
        self.conn = NvmeTcpConnection(Role.HOST)
        self.calls: dict[int, _Call] = {}
        self._free = list(range(depth, 0, -1))  # command ids
        self.parked: set[int] = set()  # AERs: outstanding for good, never waited for
        self.broken: KVOffloadError | None = None
        try:
            sock = socket.create_connection(
                (options.host, options.port), timeout=min(options.connect_timeout, _left(deadline))
            )
        except TimeoutError:
            raise DeadlineExceededError(f"connecting to {options.url} timed out") from None
        except OSError as exc:
            raise TransportError(f"cannot reach {options.url}: {exc.strerror or exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        try:
            self._initialize(deadline)
        except BaseException:
            self.close()
            raise

    def _initialize(self, deadline: float) -> None:
        self._send(self.conn.send_parts(ICReq(self.options.hdgst, self.options.ddgst)), deadline)
        while True:
            event = self._next(deadline)
            if isinstance(event, ICResp):
                return
            raise RemoteProtocolError(f"expected ICResp, got {type(event).__name__}")

    def _next(self, deadline: float) -> object:
        while (event := self._event()) is NEED_DATA:
            self._recv(deadline)
        return event

    def _event(self) -> object:
        try:
            return self.conn.next_event()
        except PduError as exc:
            # Tell the target why before closing, as a host does (H2CTermReq).
            with contextlib.suppress(KVOffloadError, OSError):
                self.sock.sendall(self.conn.send(H2CTermReq(exc.fes, exc.fei, exc.pdu)))
            error = TransportError(f"{self.options.url} broke the protocol: {exc}")
            raise self._fail(error) from None
        except RemoteProtocolError as exc:
            raise self._fail(TransportError(f"{self.options.url}: {exc}")) from None

    # ------------------------------------------------------------------ plans

    def run(self, plan: Plan[T], deadline: float) -> T:
        try:
            cmds = next(plan)
            while True:
                cmds = plan.send(self.exchange(cmds, deadline))
        except StopIteration as stop:
            return cast(T, stop.value)

    def exchange(self, cmds: Sequence[_Cmd], deadline: float) -> list[_Call]:
        """Execute `cmds` with up to `depth` in flight; returns their calls, all done."""
        if self.broken is not None:
            raise self.broken
        calls: list[_Call] = []
        for cmd in cmds:
            while not self._free:
                self._pump(deadline)
            calls.append(self.submit(cmd, deadline))
        while not all(c.done for c in calls):
            self._pump(deadline)
        return calls

    def submit(self, cmd: _Cmd, deadline: float) -> _Call:
        cid = self._free.pop()
        command = cmd.make(cid)
        data = list(cmd.data)
        in_capsule = command.sgl.type == nc.SGL_IN_CAPSULE and bool(data)
        call = _Call(command, data, cmd.sink)
        self.calls[cid] = call
        payload = data if in_capsule else []
        length = sum(len(v) for v in payload)
        self._send(self.conn.send_parts(CapsuleCmd(command, length), payload), deadline)
        return call

    def _pump(self, deadline: float) -> None:
        """Receive once and handle every complete event."""
        self._recv(deadline)
        while (event := self._event()) is not NEED_DATA:
            _EVENTS[type(event)](self, event, deadline)

    # ------------------------------------------------------------------ events

    def _on_resp(self, event: CapsuleResp, deadline: float) -> None:
        completion = event.completion
        call = self.calls.pop(completion.cid)  # the codec checked it is outstanding
        call.completion = completion
        if completion.cid in self.parked:
            self.parked.discard(completion.cid)
        self._free.append(completion.cid)

    def _on_c2h(self, event: C2HData, deadline: float) -> None:
        call = self.calls[event.cccid]
        call.pos, call.left = event.datao, event.datal
        call.received += event.datal
        self._give_sink(call)

    def _on_sink_full(self, event: SinkFull, deadline: float) -> None:
        self._give_sink(self.calls[event.cid])

    def _give_sink(self, call: _Call) -> None:
        if call.sink is None:
            return  # the codec allocates; DataEnd brings it
        buffers = call.sink(call.pos, call.left)
        if buffers is None:
            self.conn.discard_data()
            return
        self.conn.set_data_sink(buffers)
        n = sum(len(b) for b in buffers)
        call.pos += n
        call.left -= n

    def _on_data_end(self, event: DataEnd, deadline: float) -> None:
        call = self.calls[event.cid]
        call.digest_ok = call.digest_ok and event.digest_ok
        if event.data is not None:
            call.chunks.append(event.data)

    def _on_r2t(self, event: R2T, deadline: float) -> None:
        call = self.calls[event.cccid]
        step = self.conn.maxh2cdata
        end = event.r2to + event.r2tl
        parts: list[bytes | memoryview] = []
        for pos in range(event.r2to, end, step):
            n = min(step, end - pos)
            pdu = H2CData(event.cccid, event.ttag, pos, n, pos + n == end)
            parts += self.conn.send_parts(pdu, _cut(call.data, pos, pos + n))
        self._send(parts, deadline)

    def _on_term(self, event: C2HTermReq, deadline: float) -> None:
        raise self._fail(
            TransportError(
                f"{self.options.url} terminated the connection (FES {event.fes:#x}, "
                f"FEI {event.fei})"
            )
        )

    def _on_closed(self, event: ConnectionClosed, deadline: float) -> None:
        raise self._fail(TransportError(f"{self.options.url} closed the connection"))

    # ------------------------------------------------------------------ bytes

    def _send(self, parts: Sequence[bytes | memoryview], deadline: float) -> None:
        try:
            self.sock.settimeout(_left(deadline))
            _send_all(self.sock, parts)
        except DeadlineExceededError as exc:
            raise self._fail(exc) from None
        except OSError as exc:
            raise self._lost(exc) from None

    def _recv(self, deadline: float) -> None:
        try:
            self.sock.settimeout(_left(deadline))
            n = self.sock.recv_into(self.conn.get_buffer())
        except DeadlineExceededError as exc:
            raise self._fail(exc) from None
        except OSError as exc:
            raise self._lost(exc) from None
        if n:
            self.conn.buffer_updated(n)
        else:
            self.conn.receive_eof()

    def _lost(self, exc: OSError) -> KVOffloadError:
        if isinstance(exc, TimeoutError):
            return self._fail(DeadlineExceededError(f"{self.options.url} did not answer in time"))
        return self._fail(TransportError(f"connection to {self.options.url} lost: {exc}"))

    def _fail(self, error: KVOffloadError) -> KVOffloadError:
        """The queue is unusable: every call in flight fails with `error`."""
        if self.broken is None:
            self.broken = error
        for call in self.calls.values():
            call.error = call.error or error
        self.calls.clear()
        self.conn.send_failed()
        self.close()
        return error

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


_EVENTS: dict[type, Callable[[_Queue, Any, float], None]] = {
    CapsuleResp: _Queue._on_resp,
    C2HData: _Queue._on_c2h,
    SinkFull: _Queue._on_sink_full,
    DataEnd: _Queue._on_data_end,
    R2T: _Queue._on_r2t,
    C2HTermReq: _Queue._on_term,
    ConnectionClosed: _Queue._on_closed,
    ICResp: lambda q, e, d: None,  # cannot happen twice: the codec refuses a second one
}


# ---------------------------------------------------------------------------- plans


def _admin(make: Callable[[int], Command], what: str) -> Plan[_Call]:
    call = yield from _one(_Cmd(make))
    call.ok(what)
    return call


def _plan_store(
    nsid: int, key: bytes, data: list[memoryview], in_capsule: int, options: int
) -> Plan[_Call]:
    length = sum(len(v) for v in data)
    make = partial(
        _store_cmd, nsid=nsid, key=key, length=length, in_capsule=length <= in_capsule, opt=options
    )
    return (yield from _one(_Cmd(make, data)))


def _store_cmd(
    cid: int, *, nsid: int, key: bytes, length: int, in_capsule: bool, opt: int
) -> Command:
    return nc.kv_store(cid, nsid, key, length, in_capsule=in_capsule, options=opt)


def _keyed(cid: int, *, fn: Callable[..., Command], nsid: int, key: bytes, **kw: int) -> Command:
    return fn(cid, nsid, key, **kw)


def _miss(call: _Call) -> bool:
    # 87h "Key Does Not Exist": SCT 0 per SPDK, libnvme and this target; xNVMe's tests expect
    # SCT 1 for it [?], so either counts as a miss.
    return call.result().sc == Sc.KV_KEY_NOT_EXISTS and call.result().sct in _KV_MISS_SCTS


# ---------------------------------------------------------------------------- the association


class NvmeHost:
    """One association with an NVMe/TCP KV controller: an admin queue, `options.queues` I/O
    queues, Keep Alive in the background. Thread-safe; no retries (see `NvmeTransport`).

    Raises (constructor):
        TransportError, DeadlineExceededError: the target could not be reached.
        AuthError: the target refused this host NQN (Connect "Invalid Host").
        ConfigError: no such subsystem, no KV namespace, or a parameter the target refused.
        RemoteProtocolError: the target answered in a way a standard host would refuse.
    """

    def __init__(self, options: NvmeOptions) -> None:
        self.options = options
        deadline = time.monotonic() + max(options.connect_timeout, 1.0) * 2
        self._admin_lock = threading.Lock()
        self._cond = threading.Condition()
        self._idle: list[_Queue] = []
        self._io: list[_Queue] = []
        self._closed = False
        self.broken: KVOffloadError | None = None
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self.admin = _Queue(options, 0, _ADMIN_DEPTH, deadline)
        try:
            self._bring_up(deadline)
        except BaseException:
            self._close_sockets()
            raise
        if self.kato_ms:
            self._keeper = threading.Thread(
                target=self._keep_alive, name="kvoffload-nvme-keepalive", daemon=True
            )
            self._keeper.start()

    # ------------------------------------------------------------------ bring-up

    def _connect(self, queue: _Queue, sqsize: int, cntlid: int, deadline: float) -> int:
        data = nd.ConnectData(
            self.options.hostid, cntlid, self.options.subnqn, self.options.hostnqn
        )
        kato = self.options.kato_ms if queue.qid == 0 else 0
        make = partial(nc.connect, qid=queue.qid, sqsize=sqsize, kato_ms=kato)
        call = queue.run(_one(_Cmd(make, [memoryview(data.pack())])), deadline)
        c = call.result()
        if not c.ok:
            raise nvme_error_for(c.status, f"{self.options.url} refused Connect (DW0 {c.dw0:#x})")
        return c.dw0 & 0xFFFF

    def _do(self, make: Callable[[int], Command], what: str, deadline: float) -> _Call:
        return self.admin.run(_admin(make, what), deadline)

    def _prop(self, offset: int, eight: bool, deadline: float) -> int:
        c = self._do(partial(nc.property_get, offset=offset, eight=eight), "Property Get", deadline)
        return c.ok("").dw0 | (c.ok("").dw1 << 32)

    def _identify(self, cns: int, deadline: float, nsid: int = 0, csi: int = 0) -> _Call:
        return self.admin.run(
            _one(_Cmd(partial(nc.identify, cns=cns, nsid=nsid, csi=csi))), deadline
        )

    def _bring_up(self, deadline: float) -> None:
        """The Linux host's order (ref §1.10), with its checks."""
        admin = self.admin
        self.cntlid = self._connect(admin, _ADMIN_DEPTH - 1, nd.DYNAMIC_CNTLID, deadline)
        cap = self._prop(0x00, True, deadline)
        css = _CC_CSS_ALL if cap >> 43 & 1 else 0  # CAP.CSS bit 6: I/O command sets via CSS
        if not css:
            raise ConfigError(f"{self.options.url} reports no I/O command sets (CAP.CSS)")
        self._do(partial(nc.property_set, offset=0x14, value=_CC_CONFIG | css), "CC", deadline)
        self._do(
            partial(nc.property_set, offset=0x14, value=_CC_CONFIG | css | _CC_EN), "CC", deadline
        )
        ready_by = time.monotonic() + ((cap >> 24) & 0xFF) * 0.5
        while True:
            csts = self._prop(0x1C, False, deadline)
            if csts & _CSTS_CFS:
                raise RemoteProtocolError(f"{self.options.url}: controller fatal status on enable")
            if csts & _CSTS_RDY:
                break
            if time.monotonic() > ready_by:
                raise DeadlineExceededError(f"{self.options.url} never became ready")
            time.sleep(0.01)
        self.version = self._prop(0x08, False, deadline)
        ctrl = nd.IdentifyController.unpack(
            self._identify(nd.Cns.CONTROLLER, deadline).check("Identify").read_data()
        )
        problems = []
        if ctrl.cntlid != self.cntlid:
            problems.append(f"CNTLID {ctrl.cntlid} != {self.cntlid} from Connect")
        if ctrl.kas == 0 or ctrl.ioccsz < 4 or ctrl.iorcsz < 1 or ctrl.icdoff != 0:
            problems.append("KAS, IOCCSZ, IORCSZ or ICDOFF unusable")
        if ctrl.sgls & 0x3 == 0:
            problems.append("no SGL support")
        if ctrl.subnqn != self.options.subnqn:
            problems.append(f"SUBNQN {ctrl.subnqn!r}")
        if problems:
            raise RemoteProtocolError(f"{self.options.url}: bad Identify Controller: {problems}")
        self.controller = ctrl
        # Tolerated like Linux/SPDK: an NVM controller structure, the KV one.
        self._identify(nd.Cns.CSI_CONTROLLER, deadline, csi=nd.Csi.NVM)
        self._identify(nd.Cns.CSI_CONTROLLER, deadline, csi=nd.Csi.KV)
        wanted = self.options.queues
        granted = self._do(
            partial(nc.set_features, fid=0x07, cdw11=(wanted - 1) | ((wanted - 1) << 16)),
            "Set Features (number of queues)",
            deadline,
        ).ok("")
        queues = min(wanted, (granted.dw0 & 0xFFFF) + 1, (granted.dw0 >> 16) + 1)
        self.kato_ms = self.options.kato_ms
        kato = self._identify_kato(deadline)
        if kato is not None:
            self.kato_ms = kato
        self.nsid, self.namespace = self._pick_namespace(deadline)
        self._do(nc.keep_alive, "Keep Alive", deadline)
        # One AER, parked by the target until something happens (nothing does, here).
        aer = admin.submit(_Cmd(nc.async_event), deadline)
        admin.parked.add(aer.command.cid)
        depth = min(self.options.depth, ctrl.maxcmd, ((cap & 0xFFFF) + 1))
        self.in_capsule = ctrl.in_capsule_bytes
        for qid in range(1, queues + 1):
            queue = _Queue(self.options, qid, depth, deadline)
            self._io.append(queue)
            self._connect(queue, depth - 1, self.cntlid, deadline)
            queue.conn.in_capsule = self.in_capsule
        self._idle = list(self._io)

    def _identify_kato(self, deadline: float) -> int | None:
        call = self.admin.run(_one(_Cmd(partial(nc.get_features, fid=0x0F))), deadline)
        c = call.result()
        return c.dw0 if c.ok else None

    def _pick_namespace(self, deadline: float) -> tuple[int, nd.KvNamespace]:
        listed = nd.active_namespaces(
            self._identify(nd.Cns.ACTIVE_NAMESPACES, deadline).check("Identify").read_data()
        )
        wanted = [self.options.nsid] if self.options.nsid else listed
        for nsid in wanted:
            if nsid not in listed:
                raise ConfigError(f"{self.options.url} has no namespace {nsid} for this host")
            ids = nd.descriptors(
                self._identify(nd.Cns.DESCRIPTORS, deadline, nsid=nsid)
                .check("Identify")
                .read_data()
            )
            if ids.get(nd.Nidt.CSI) != bytes((nd.Csi.KV,)):
                continue
            independent = nd.NamespaceIndependent.unpack(
                self._identify(nd.Cns.INDEPENDENT_NAMESPACE, deadline, nsid=nsid)
                .check("Identify")
                .read_data()
            )
            if not independent.ready:
                continue
            kv = nd.KvNamespace.unpack(
                self._identify(nd.Cns.CSI_NAMESPACE, deadline, nsid=nsid, csi=nd.Csi.KV)
                .check("Identify")
                .read_data()
            )
            # SPDK counts a namespace as active only with NCAP != 0 in the NVM structure.
            nvm = nd.NvmNamespaceShim.unpack(
                self._identify(nd.Cns.NAMESPACE, deadline, nsid=nsid).check("Identify").read_data()
            )
            effects = nd.EffectsLog.unpack(
                self._do(
                    partial(nc.get_log_page, lid=nd.Lid.EFFECTS, length=4096, csi=nd.Csi.KV),
                    "Get Log Page (effects)",
                    deadline,
                ).read_data()
            )
            needed = (nc.KvOpc.STORE, nc.KvOpc.RETRIEVE, nc.KvOpc.EXIST, nc.KvOpc.DELETE)
            if nvm.ncap and all(effects.io.get(opc, 0) & 1 for opc in needed):
                return nsid, kv
        raise ConfigError(f"{self.options.url} offers this host no usable KV namespace")

    # ------------------------------------------------------------------ running commands

    def run(self, plan: Plan[T], deadline: float) -> T:
        """Run a plan on an idle I/O queue.

        Raises:
            TransportError, DeadlineExceededError: the queue failed (the association is then
                closed: every queue of it is unusable).
        """
        queue = self._acquire(deadline)
        ok = False
        try:
            result = queue.run(plan, deadline)
            ok = True
            return result
        except (TransportError, DeadlineExceededError) as exc:
            self._break(exc)
            raise
        finally:
            self._release(queue, ok)

    def admin_command(
        self, make: Callable[[int], Command], deadline: float | None = None
    ) -> tuple[Completion, bytes]:
        """Run one admin command; returns its completion and the data it read."""
        deadline = deadline or time.monotonic() + self.options.timeout
        with self._admin_lock:
            try:
                call = self.admin.run(_one(_Cmd(make)), deadline)
            except (TransportError, DeadlineExceededError) as exc:
                self._break(exc)
                raise
        return call.result(), bytes(call.read_data()) if call.chunks else b""

    def io_command(
        self,
        make: Callable[[int], Command],
        data: Sequence[object] = (),
        deadline: float | None = None,
    ) -> tuple[Completion, bytes]:
        """Run one I/O command as built by `make(cid)`, sending `data` (in the capsule if its
        SGL says so, else on R2T); returns its completion and the data it read."""
        deadline = deadline or time.monotonic() + self.options.timeout
        call = self.run(_one(_Cmd(make, _views(data))), deadline)
        return call.result(), bytes(call.read_data()) if call.chunks else b""

    def _acquire(self, deadline: float) -> _Queue:
        with self._cond:
            while True:
                if self.broken is not None:
                    raise self.broken
                if self._closed:
                    raise TransportError("the NVMe/TCP host is closed")
                if self._idle:
                    return self._idle.pop()
                if not self._cond.wait(timeout=_left(deadline)):
                    raise DeadlineExceededError(f"no free I/O queue to {self.options.url}")

    def _release(self, queue: _Queue, ok: bool) -> None:
        with self._cond:
            if queue.broken is None:
                self._idle.append(queue)
            self._cond.notify()

    def _break(self, error: KVOffloadError) -> None:
        with self._cond:
            if self.broken is None:
                self.broken = (
                    error if isinstance(error, TransportError) else TransportError(str(error))
                )
            self._cond.notify_all()
        self._close_sockets()

    def _keep_alive(self) -> None:
        # Well inside KATO: the target tears the association down after KATO of silence.
        period = max(0.05, self.kato_ms / 1000 / 3)
        while not self._stop.wait(period):
            try:
                self.admin_command(nc.keep_alive, time.monotonic() + max(period, 1.0))
            except KVOffloadError as exc:
                log.warning("keep-alive to %s failed: %s", self.options.url, exc)
                return

    # ------------------------------------------------------------------ KV commands

    def store(
        self,
        key: bytes,
        parts: Sequence[object],
        *,
        options: int = 0,
        deadline: float | None = None,
    ) -> Completion:
        """KV Store of the concatenation of `parts` (in the capsule or by R2T, by size)."""
        deadline = deadline or time.monotonic() + self.options.timeout
        plan = _plan_store(self.nsid, key, _views(parts), self.in_capsule, options)
        return self.run(plan, deadline).result()

    def retrieve(
        self, key: bytes, size: int, deadline: float | None = None
    ) -> tuple[Completion, bytes]:
        """KV Retrieve into a `size`-byte host buffer: (completion, the bytes sent)."""
        deadline = deadline or time.monotonic() + self.options.timeout
        make = partial(_keyed, fn=nc.kv_retrieve, nsid=self.nsid, key=key, buffer_size=size)
        call = self.run(_one(_Cmd(make)), deadline)
        return call.result(), bytes(call.read_data()) if call.chunks else b""

    def exist(self, key: bytes, deadline: float | None = None) -> Completion:
        return self._simple(nc.kv_exist, key, deadline)

    def delete(self, key: bytes, deadline: float | None = None) -> Completion:
        return self._simple(nc.kv_delete, key, deadline)

    def list(
        self, start: bytes = b"", size: int = 4096, deadline: float | None = None
    ) -> tuple[Completion, list[bytes]]:
        """KV List from `start` (b"": from the beginning) into a `size`-byte buffer."""
        deadline = deadline or time.monotonic() + self.options.timeout
        make = partial(_keyed, fn=nc.kv_list, nsid=self.nsid, key=start, buffer_size=size)
        call = self.run(_one(_Cmd(make)), deadline)
        c = call.result()
        return c, nd.list_data(call.read_data()) if c.ok and call.chunks else []

    def _simple(self, fn: Callable[..., Command], key: bytes, deadline: float | None) -> Completion:
        deadline = deadline or time.monotonic() + self.options.timeout
        make = partial(_keyed, fn=fn, nsid=self.nsid, key=key)
        return self.run(_one(_Cmd(make)), deadline).result()

    # ------------------------------------------------------------------ closing

    def close(self, timeout: float = 2.0) -> None:
        """Shut the controller down (CC.SHN, wait for CSTS.SHST) and close every queue."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._stop.set()
        if self.broken is None:
            deadline = time.monotonic() + timeout
            with contextlib.suppress(KVOffloadError):
                cc = _CC_CONFIG | _CC_CSS_ALL | _CC_EN | _CC_SHN_NORMAL
                self.admin_command(partial(nc.property_set, offset=0x14, value=cc), deadline)
                while time.monotonic() < deadline:
                    c, _ = self.admin_command(
                        partial(nc.property_get, offset=0x1C, eight=False), deadline
                    )
                    if c.dw0 & _CSTS_SHST_MASK == _CSTS_SHST_DONE:
                        break
                    time.sleep(0.01)
        self._close_sockets()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(timeout=timeout)

    def _close_sockets(self) -> None:
        for queue in [self.admin, *self._io]:
            queue.close()


# ---------------------------------------------------------------------------- the Transport


@dataclass(frozen=True, slots=True)
class _Held:
    data: memoryview

    def release(self) -> None:
        pass


def _peek_length(header: memoryview) -> int | None:
    """The payload length a stored block's header claims (None if it is not one of ours)."""
    if len(header) < HEADER_BYTES or bytes(header[:4]) != b"KVOB":
        return None
    (stored,) = struct.unpack_from("<Q", header, 20)
    return int(stored)


class NvmeTransport:
    """The SDK `Transport` over an `NvmeHost`, reconnecting and retrying like `kv://`."""

    def __init__(self, options: NvmeOptions) -> None:
        self.options = options
        self._retry = _Retrying(options)  # type: ignore[arg-type]
        self._host: NvmeHost | None = None
        self._lock = threading.Lock()
        self._closed = False
        try:  # connect now for an early refusal; a target that is down is only a warning
            self._association(time.monotonic() + options.connect_timeout * 2)
        except (TransportError, DeadlineExceededError) as exc:
            log.warning("%s is not reachable yet (%s); will retry on use", options.url, exc)

    def _association(self, deadline: float) -> NvmeHost:
        with self._lock:
            if self._closed:
                raise TransportError("the client is closed")
            host = self._host
            if host is None or host.broken is not None:
                if host is not None:
                    host.close()
                _left(deadline)
                self._host = host = NvmeHost(self.options)
            return host

    def _run(self, plan: Callable[[NvmeHost], Plan[T]]) -> T:
        deadline = time.monotonic() + self.options.timeout
        delays = self._retry.delays(deadline)
        while True:
            try:
                host = self._association(deadline)
                return host.run(plan(host), deadline)
            except TransportError as exc:
                wait = next(delays, None)
                if wait is None:
                    raise
                log.debug("retrying after %s", exc)
                time.sleep(wait)

    @property
    def max_value_bytes(self) -> int:
        host = self._association(time.monotonic() + self.options.timeout)
        return host.namespace.max_value

    def put(
        self, key: bytes, parts: Sequence[object], parent: bytes | None, durable: bool = False
    ) -> None:
        if durable:
            raise InvalidArgumentError("nvme+tcp:// has no durable stores (no FUA in KV Store)")
        self._run(lambda h: _checked(_plan_store(h.nsid, key, _views(parts), h.in_capsule, 0)))

    def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        if durable:
            raise InvalidArgumentError("nvme+tcp:// has no durable stores (no FUA in KV Store)")
        self._run(lambda h: _plan_store_many(h, items))

    def get(self, key: bytes) -> HeldBlock | None:
        return self._run(lambda h: _plan_get(h, key))

    def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None:
        into = IntoBuffer(buffer)
        return received_into(into, lambda: self._run(lambda h: _plan_get_into(h.nsid, key, into)))

    def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        return self._run(lambda h: _plan_get_many(h, keys))

    def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]:
        into = [IntoBuffer(b) for b in buffers]
        got = received_many_into(
            into, lambda: self._run(lambda h: _plan_get_many_into(h.nsid, keys, into))
        )
        return list(got)

    def exists(self, key: bytes) -> bool:
        return self._run(lambda h: _plan_exists(h.nsid, key))

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self._run(lambda h: _plan_lookup(h.nsid, keys, 4 * h.options.depth))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        # NVMe KV has no prefetch: count what is there (every tier of the store serves reads).
        return self._run(lambda h: _plan_count(h.nsid, keys))

    def delete(self, key: bytes) -> bool:
        return self._run(lambda h: _plan_delete(h.nsid, key))

    def stats(self) -> dict[str, object]:
        host = self._association(time.monotonic() + self.options.timeout)
        c, raw = host.admin_command(partial(nc.get_log_page, lid=nd.Lid.SMART, length=512))
        smart = nd.SmartLog.unpack(raw) if c.ok else nd.SmartLog()
        c, raw = host.admin_command(
            partial(nc.identify, cns=nd.Cns.CSI_NAMESPACE, nsid=host.nsid, csi=nd.Csi.KV)
        )
        ns = nd.KvNamespace.unpack(raw) if c.ok else host.namespace
        return {
            "transport": "nvme+tcp",
            "subnqn": self.options.subnqn,
            "cntlid": host.cntlid,
            "nsid": host.nsid,
            "capacity_bytes": ns.nsze,
            "used_bytes": ns.nuse,
            "max_value_bytes": ns.max_value,
            "data_units_read": smart.data_units_read,
            "data_units_written": smart.data_units_written,
            "host_reads": smart.host_reads,
            "host_writes": smart.host_writes,
        }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            host, self._host = self._host, None
        if host is not None:
            host.close()


def _checked(plan: Plan[_Call]) -> Plan[None]:
    call = yield from plan
    call.ok("KV Store")


def _plan_store_many(host: NvmeHost, items: Sequence[PutItem]) -> Plan[None]:
    cmds = []
    for key, parts, _ in items:
        data = _views(parts)
        length = sum(len(v) for v in data)
        make = partial(
            _store_cmd,
            nsid=host.nsid,
            key=key,
            length=length,
            in_capsule=length <= host.in_capsule,
            opt=0,
        )
        cmds.append(_Cmd(make, data))
    calls = yield cmds
    for call in calls:  # the first failure in order is the one to report
        call.ok("KV Store")


def _retrieve_cmd(host: NvmeHost, key: bytes) -> _Cmd:
    size = host.namespace.max_value
    return _Cmd(partial(_keyed, fn=nc.kv_retrieve, nsid=host.nsid, key=key, buffer_size=size))


def _held(call: _Call) -> HeldBlock | None:
    if _miss(call):
        return None
    c = call.ok("KV Retrieve")
    data = call.read_data() if call.chunks else memoryview(b"")
    if c.dw0 != len(data):  # the buffer was the namespace's largest value: never short
        raise RemoteProtocolError(f"Retrieve sent {len(data)} of a {c.dw0}-byte value")
    return _Held(data)


def _plan_get(host: NvmeHost, key: bytes) -> Plan[HeldBlock | None]:
    call = yield from _one(_retrieve_cmd(host, key))
    return _held(call)


def _plan_get_many(host: NvmeHost, keys: Sequence[bytes]) -> Plan[list[HeldBlock | None]]:
    calls = yield [_retrieve_cmd(host, k) for k in keys]
    return [_held(c) for c in calls]


def _retrieve_into(
    nsid: int, key: bytes, buffer: IntoBuffer
) -> tuple[_Cmd, Callable[[_Call], Received | None]]:
    """A KV Retrieve whose value lands in `buffer` (its header apart), and what reads its
    completion."""
    header = memoryview(bytearray(HEADER_BYTES))
    too_small = False

    def sink(offset: int, left: int) -> list[memoryview] | None:
        nonlocal too_small
        if offset < HEADER_BYTES:  # the block header first: it says how long the block is
            return [header[offset : min(HEADER_BYTES, offset + left)]]
        claimed = _peek_length(header)
        if claimed is not None and claimed > len(buffer):
            too_small = True  # drop the rest: nothing is written into the caller's buffer
        if too_small:
            return None
        start = offset - HEADER_BYTES
        return [buffer.region(start, start + left)]

    size = HEADER_BYTES + len(buffer)

    def result(call: _Call) -> Received | None:
        if _miss(call):
            return None
        c = call.ok("KV Retrieve")
        if too_small or c.dw0 > size:
            # (a block that is not one of ours may have written some bytes: the caller's
            # received_into clears them)
            raise InvalidArgumentError(
                f"buffer of {len(buffer)} bytes is too small for a "
                f"{c.dw0 - HEADER_BYTES}-byte block"
            )
        if c.dw0 < HEADER_BYTES:  # not one of ours: verification will say so
            return Received(header[: c.dw0], 0)
        return Received(header, c.dw0 - HEADER_BYTES)

    make = partial(_keyed, fn=nc.kv_retrieve, nsid=nsid, key=key, buffer_size=size)
    return _Cmd(make, sink=sink), result


def _plan_get_into(nsid: int, key: bytes, buffer: IntoBuffer) -> Plan[Received | None]:
    cmd, result = _retrieve_into(nsid, key, buffer)
    return result((yield from _one(cmd)))


def _plan_get_many_into(
    nsid: int, keys: Sequence[bytes], buffers: Sequence[IntoBuffer]
) -> Plan[list[Received | None]]:
    """One Retrieve per key, all in flight together (queue depth permitting)."""
    retrievals = [_retrieve_into(nsid, k, b) for k, b in zip(keys, buffers, strict=True)]
    calls = yield [cmd for cmd, _ in retrievals]
    return [result(call) for (_, result), call in zip(retrievals, calls, strict=True)]


def _plan_exists(nsid: int, key: bytes) -> Plan[bool]:
    call = yield from _one(_Cmd(partial(_keyed, fn=nc.kv_exist, nsid=nsid, key=key)))
    if _miss(call):
        return False
    call.ok("KV Exist")
    return True


def _plan_delete(nsid: int, key: bytes) -> Plan[bool]:
    call = yield from _one(_Cmd(partial(_keyed, fn=nc.kv_delete, nsid=nsid, key=key)))
    if _miss(call):
        return False
    call.ok("KV Delete")
    return True


def _plan_lookup(nsid: int, keys: Sequence[bytes], window: int) -> Plan[int]:
    """Leading keys present: Exist commands pipelined a window at a time, stopping at a miss."""
    total = 0
    for i in range(0, len(keys), window):
        chunk = keys[i : i + window]
        calls = yield [_Cmd(partial(_keyed, fn=nc.kv_exist, nsid=nsid, key=k)) for k in chunk]
        for call in calls:
            if _miss(call):
                return total
            call.ok("KV Exist")
            total += 1
    return total


def _plan_count(nsid: int, keys: Sequence[bytes]) -> Plan[int]:
    calls = yield [_Cmd(partial(_keyed, fn=nc.kv_exist, nsid=nsid, key=k)) for k in keys]
    found = 0
    for call in calls:
        if not _miss(call):
            call.ok("KV Exist")
            found += 1
    return found


def open_nvme(url: StoreURL) -> NvmeTransport:
    """Open `nvme+tcp://host:4420/<subsystem NQN>?hostnqn=...` (blocking)."""
    return NvmeTransport(NvmeOptions.from_url(url))
