"""Coverage-guided fuzz harnesses (atheris, libFuzzer) for the sans-I/O wire codecs.

Run one harness per process (atheris ends the process when it is done):

    python tests/reliability/fuzz_codecs.py TARGET [libFuzzer flags] [corpus dirs]
    python tests/reliability/fuzz_codecs.py --seeds TARGET DIR   # write the seed corpus

Targets: native-server, native-client (kvoffload/wire/native/connection.py, frames.py, rxbuffer.py),
nvme-target, nvme-host (nvme_tcp.py, nvme_cmd.py) and nvme-data (nvme_data.py, nvme_cmd.py
unpackers). Each input is one byte choosing how the stream is chunked (and how payloads are
taken), then the byte stream a peer sends. A harness fails (an uncaught exception, which atheris
reports as a crash) when the codec raises anything but its documented error, or asks for memory
beyond its limits: every buffer the receive side allocates is recorded and checked.

Seeds are real conversations: a client and a server codec (host and target) talk to each other
through the encoders, and what each side receives is a seed of the other's harness.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["kvoffload"]):
    from kvoffload.errors import LocalProtocolError, RemoteProtocolError
    from kvoffload.wire.native import connection as nw
    from kvoffload.wire.native.frames import FRAME, Limits
    from kvoffload.wire.nvme_tcp import cmd as nc
    from kvoffload.wire.nvme_tcp import connection as nt
    from kvoffload.wire.nvme_tcp import data as nd
    from kvoffload.wire.rxbuffer import ReceiveBuffer

# Small limits, so that a bound that does not hold shows at once.
LIMITS = Limits(max_header_bytes=1 << 20, max_payload_bytes=1 << 20, max_pending=16)
HELLO_LIMITS = Limits(max_header_bytes=4096, max_payload_bytes=0, max_pending=16)
IN_CAPSULE = 16 << 10
MAXH2CDATA = 64 << 10
HOST_BUFFER = 32 << 10  # the largest transfer a host command of the harness asks for
_CHUNKS = (1, 2, 3, 7, 24, 100, 4096, 1 << 30)

# ---------------------------------------------------------------------------- allocation bound
# The receive side allocates in two places: its parse buffer (`_make_room`) and a payload
# nobody claimed (`_allocate`). The largest of each since the input began is checked after it.
_biggest = {"buffer": 0, "payload": 0}
_make_room = ReceiveBuffer._make_room
_allocate = ReceiveBuffer._allocate


def _tracked_make_room(self: ReceiveBuffer) -> None:
    _make_room(self)
    _biggest["buffer"] = max(_biggest["buffer"], len(self._buf))


def _tracked_allocate(self: ReceiveBuffer) -> None:
    _biggest["payload"] = max(_biggest["payload"], self._left)
    _allocate(self)


ReceiveBuffer._make_room = _tracked_make_room  # type: ignore[method-assign]
ReceiveBuffer._allocate = _tracked_allocate  # type: ignore[method-assign]


def _check_bounds(buffer: int, payload: int) -> None:
    if _biggest["buffer"] > buffer or _biggest["payload"] > payload:
        raise AssertionError(
            f"allocation beyond the limits: {_biggest} (bounds {buffer}, {payload})"
        )


def _chunks(data: bytes) -> tuple[int, list[bytes]]:
    if not data:
        return 0, []
    mode, stream = data[0], data[1:]
    size = _CHUNKS[mode % len(_CHUNKS)]
    return mode, [stream[i : i + size] for i in range(0, len(stream), size)]


# ---------------------------------------------------------------------------- native protocol

KEYS = [bytes([i]) * 16 for i in range(1, 5)]


def _native_pair() -> tuple[nw.NativeConnection, nw.NativeConnection]:
    return nw.NativeConnection(nw.Role.CLIENT, LIMITS), nw.NativeConnection(nw.Role.SERVER, LIMITS)


# The client requests the client harness has outstanding before its input arrives.
_CLIENT_REQUESTS: list[tuple[nw.Event, list[bytes]]] = [
    (nw.Hello(1, token="t", client="fuzz"), []),
    (nw.Put(2, KEYS[0], 5), [b"hello"]),
    (nw.Get(3, KEYS[0]), []),
    (nw.GetMany(4, tuple(KEYS)), []),
    (nw.Exists(5, KEYS[1]), []),
    (nw.Delete(6, KEYS[2]), []),
    (nw.PutMany(7, tuple(KEYS[:2]), (3, 4), (None, KEYS[0]), True), [b"abc", b"defg"]),
    (nw.Lookup(8, tuple(KEYS)), []),
    (nw.Prefetch(9, tuple(KEYS)), []),
    (nw.Stats(10), []),
    (nw.Get(11, KEYS[3]), []),
]
_ANSWERS: list[tuple[nw.Event, list[bytes]]] = [
    (nw.Welcome(1, 1, "tenant", 1 << 20, 1 << 20, server="fuzz"), []),
    (nw.PutDone(2), []),
    (nw.GetResult(3, 5), [b"hello"]),
    (nw.GetManyResult(4, (5, None, 2)), [b"hello", b"xy"]),
    (nw.ExistsResult(5, True), []),
    (nw.DeleteResult(6, False), []),
    (nw.PutManyDone(7), []),
    (nw.LookupResult(8, 2), []),
    (nw.PrefetchResult(9, 1), []),
    (nw.StatsResult(10, {"store": {"keys": 3, "tiers": [{"pinned": 0}]}, "x": 1.5}), []),
    (nw.ErrorReply(11, 5, "no"), []),
    (nw.ErrorReply(0, 1, "bye"), []),
]


def native_seeds(role: nw.Role) -> list[bytes]:
    client, server = _native_pair()
    to_server = b"".join(client.send(e, p) for e, p in _CLIENT_REQUESTS)
    to_client = b"".join(server.send(e, p) for e, p in _seed_server_side(server, to_server))
    stream = to_server if role is nw.Role.SERVER else to_client
    seeds = [bytes([mode]) + stream for mode in range(0, 256, 0x11)]
    # A few single frames, so the fuzzer also starts from short inputs.
    return seeds + [b"\x07" + stream[: FRAME.size + n] for n in (0, 8, 40)]


def _seed_server_side(
    server: nw.NativeConnection, received: bytes
) -> list[tuple[nw.Event, list[bytes]]]:
    server.receive_data(received)
    while server.next_event() is not nw.NEED_DATA:
        pass  # admit every request, so the answers are allowed
    return _ANSWERS


def fuzz_native(data: bytes, role: nw.Role) -> None:
    mode, chunks = _chunks(data)
    server = role is nw.Role.SERVER
    conn = nw.NativeConnection(role, HELLO_LIMITS if server else LIMITS)
    if not server:
        for event, payload in _CLIENT_REQUESTS:
            conn.send(event, payload)
    _biggest.update(buffer=0, payload=0)
    try:
        for chunk in [*chunks, b""]:
            conn.receive_data(chunk)
            while True:
                event = conn.next_event()
                if event is nw.NEED_DATA or isinstance(event, nw.ConnectionClosed):
                    break
                if isinstance(event, nw.Hello):
                    conn.set_limits(LIMITS)  # as the daemon does once a Hello is accepted
                if isinstance(event, nw.Event) and event.payload_length:
                    if event.payload_length > conn.limits.max_payload_bytes:
                        raise AssertionError(f"{event} beyond {conn.limits}")
                    _take_payload(conn, event.payload_length, mode)
                elif isinstance(event, nw.SinkFull):
                    _take_payload(conn, event.remaining, mode)
    except RemoteProtocolError:
        try:
            conn.next_event()
        except RemoteProtocolError:
            pass  # broken for good, as documented
        else:
            raise AssertionError("a broken connection went on parsing") from None
    # The parse buffer holds what arrived (at most twice that while it grows) past its 64 KiB
    # floor: declaring a large header costs nothing until its bytes come.
    _check_bounds(2 * len(data) + (72 << 10), LIMITS.max_payload_bytes)


def _take_payload(conn: nw.NativeConnection, length: int, mode: int) -> None:
    how = (mode >> 4) % 4
    if how == 0:
        conn.set_payload_sink([memoryview(bytearray(length))])
    elif how == 1:
        conn.discard_payload()
    elif how == 2:  # piece by piece, as the daemon takes a batch's values
        conn.set_payload_part([memoryview(bytearray(min(length, 1 + mode % 7)))])
    # else: the connection allocates


# ---------------------------------------------------------------------------- NVMe/TCP

_HOST_COMMANDS = [
    nc.kv_retrieve(1, 1, KEYS[0], HOST_BUFFER),
    nc.kv_store(2, 1, KEYS[1], 1000, in_capsule=False),
    nc.identify(3, nd.Cns.CONTROLLER),
    nc.kv_exist(4, 1, KEYS[2]),
    nc.get_log_page(5, 2, 512),
    nc.kv_list(6, 1, b"", 4096),
]


def _host_start(conn: nt.NvmeTcpConnection, mode: int) -> bytes:
    return conn.send(nt.ICReq(hdgst=bool(mode & 0x40), ddgst=bool(mode & 0x80)))


def _host_after_icresp(conn: nt.NvmeTcpConnection) -> bytes:
    out = [conn.send(nt.CapsuleCmd(c)) for c in _HOST_COMMANDS[:-1]]
    # One store with in-capsule data too.
    store = nc.kv_store(7, 1, KEYS[3], 100, in_capsule=True)
    out.append(conn.send(nt.CapsuleCmd(store, 100), [bytes(100)]))
    return b"".join(out)


# Bytes the harness's target still waits for, per command it sent an R2T for: DataEnd closes
# one H2CData PDU, and a command is answered only once its R2T's data is all in (as the daemon
# does).
_r2t_left: dict[int, int] = {}


def _target_answer(conn: nt.NvmeTcpConnection, event: nt.Event) -> bytes:
    """What the harness's target sends back for an event: enough to let the host go on."""
    if isinstance(event, nt.ICReq):
        return conn.send(nt.ICResp(event.hdgst, event.ddgst, MAXH2CDATA))
    if isinstance(event, nt.CapsuleCmd):
        cmd = event.command
        length = cmd.sgl.length if cmd.sgl.type == nc.SGL_TRANSPORT else 0
        if cmd.direction is nc.Direction.TO_CONTROLLER and length and not event.data_length:
            _r2t_left[cmd.cid] = min(length, MAXH2CDATA)
            return conn.send(nt.R2T(cmd.cid, 7, 0, _r2t_left[cmd.cid]))
        if cmd.direction in (nc.Direction.TO_HOST, nc.Direction.BOTH) and length:
            n = min(length, 300)  # short: the harness parses it, no need for real content
            data = conn.send(nt.C2HData(cmd.cid, 0, n, last=True), [bytes(n)])
            return data + conn.send(nt.CapsuleResp(nc.Completion(cmd.cid)))
        if not event.data_length:
            return conn.send(nt.CapsuleResp(nc.Completion(cmd.cid)))
    if isinstance(event, nt.H2CData) and event.cccid in _r2t_left:
        _r2t_left[event.cccid] -= event.datal
    if isinstance(event, nt.DataEnd) and _r2t_left.get(event.cid, 0) <= 0:
        _r2t_left.pop(event.cid, None)
        return conn.send(nt.CapsuleResp(nc.Completion(event.cid)))
    return b""


def nvme_seeds(role: nt.Role) -> list[bytes]:
    seeds = []
    for mode in range(0, 256, 0x11):
        host = nt.NvmeTcpConnection(nt.Role.HOST)
        target = nt.NvmeTcpConnection(nt.Role.TARGET, in_capsule=IN_CAPSULE, maxh2cdata=MAXH2CDATA)
        to_target, to_host = [_host_start(host, mode)], []
        # Talk until neither side has more to say.
        pending = to_target[0]
        for _ in range(20):
            target.receive_data(pending)
            answers = b""
            while (ev := target.next_event()) is not nt.NEED_DATA:
                answers += _target_answer(target, ev)
            to_host.append(answers)
            host.receive_data(answers)
            pending = b""
            while (ev := host.next_event()) is not nt.NEED_DATA:
                if isinstance(ev, nt.ICResp):
                    pending += _host_after_icresp(host)
                elif isinstance(ev, nt.R2T):
                    data = [bytes(ev.r2tl)]
                    pending += host.send(
                        nt.H2CData(ev.cccid, ev.ttag, ev.r2to, ev.r2tl, True), data
                    )
            if not pending:
                break
            to_target.append(pending)
        stream = b"".join(to_target if role is nt.Role.TARGET else to_host)
        seeds.append(bytes([mode]) + stream)
    return seeds


def fuzz_nvme(data: bytes, role: nt.Role) -> None:
    mode, chunks = _chunks(data)
    if role is nt.Role.TARGET:
        conn = nt.NvmeTcpConnection(role, in_capsule=IN_CAPSULE, maxh2cdata=MAXH2CDATA)
        payload_bound = max(IN_CAPSULE, MAXH2CDATA)
    else:
        conn = nt.NvmeTcpConnection(role)
        _host_start(conn, mode)
        payload_bound = HOST_BUFFER
    _biggest.update(buffer=0, payload=0)
    _r2t_left.clear()
    try:
        for chunk in [*chunks, b""]:
            conn.receive_data(chunk)
            while True:
                event = conn.next_event()
                if event is nt.NEED_DATA or isinstance(event, nt.ConnectionClosed):
                    break
                _nvme_react(conn, event, mode)
    except RemoteProtocolError:
        try:
            conn.next_event()
        except RemoteProtocolError:
            pass
        else:
            raise AssertionError("a broken connection went on parsing") from None
    _check_bounds(64 << 10, payload_bound)


def _nvme_react(conn: nt.NvmeTcpConnection, event: nt.Event, mode: int) -> None:
    """Play the harness's side of the conversation, as the daemon or the SDK would."""
    if conn.role is nt.Role.TARGET:
        _target_answer(conn, event)
    elif isinstance(event, nt.ICResp):
        _host_after_icresp(conn)
    elif isinstance(event, nt.R2T):
        conn.send(
            nt.H2CData(event.cccid, event.ttag, event.r2to, event.r2tl, True), [bytes(event.r2tl)]
        )
    elif isinstance(event, nt.CapsuleResp):
        event.completion.ok  # noqa: B018 (decode the status bits)
    data_length = getattr(event, "data_length", 0) or getattr(event, "datal", 0)
    if isinstance(event, (nt.CapsuleCmd, nt.H2CData, nt.C2HData)) and data_length:
        how = (mode >> 4) % 3
        if how == 0:
            conn.set_data_sink([memoryview(bytearray(min(data_length, 1000)))])
        elif how == 1:
            conn.discard_data()
    elif isinstance(event, nt.SinkFull):
        conn.discard_data()


# ---------------------------------------------------------------------------- NVMe data structures

_DATA_PARSERS: list[Callable[[bytes], object]] = [
    nd.ConnectData.unpack,
    nd.IdentifyController.unpack,
    nd.KvNamespace.unpack,
    nd.NvmNamespaceShim.unpack,
    nd.NamespaceIndependent.unpack,
    nd.active_namespaces,
    nd.descriptors,
    nd.EffectsLog.unpack,
    nd.SmartLog.unpack,
    nd.list_data,
    # The codec hands these exactly one SQE / CQE.
    lambda raw: nc.Command.unpack(raw[: nc.SQE.size].ljust(nc.SQE.size, b"\0")),
    lambda raw: nc.Completion.unpack(raw[: nc.CQE.size].ljust(nc.CQE.size, b"\0")),
]


def data_seeds() -> list[bytes]:
    samples = [
        nd.ConnectData(
            bytes(16), 0xFFFF, "nqn.2026-11.io.kvoffload:store", "nqn.2014-08.h:x"
        ).pack(),
        nd.IdentifyController(1, "nqn.2026-11.io.kvoffload:store").pack(),
        nd.KvNamespace(1 << 30, 1 << 20, 1 << 20).pack(),
        bytes(4096),
        bytes(4096),
        nd.pack_active_namespaces([1, 2, 3], 0),
        nd.pack_descriptors([(nd.Nidt.NGUID, bytes(range(16))), (nd.Nidt.CSI, b"\x01")]),
        bytes(4096),
        bytes(512),
        nd.pack_list_data(KEYS, 4096)[0],
        nc.kv_store(9, 1, KEYS[0], 10, in_capsule=True).pack(),
        nc.Completion(9, 2).pack(),
    ]
    return [bytes([i]) + s for i, s in enumerate(samples)]


def fuzz_data(data: bytes) -> None:
    if not data:
        return
    parser = _DATA_PARSERS[data[0] % len(_DATA_PARSERS)]
    # LocalProtocolError: the parsers' documented error for a structure that does not add up.
    with contextlib.suppress(LocalProtocolError):
        parser(data[1:])


# ---------------------------------------------------------------------------- entry

TARGETS: dict[str, tuple[Callable[[bytes], None], Callable[[], list[bytes]]]] = {
    "native-server": (
        lambda d: fuzz_native(d, nw.Role.SERVER),
        lambda: native_seeds(nw.Role.SERVER),
    ),
    "native-client": (
        lambda d: fuzz_native(d, nw.Role.CLIENT),
        lambda: native_seeds(nw.Role.CLIENT),
    ),
    "nvme-target": (lambda d: fuzz_nvme(d, nt.Role.TARGET), lambda: nvme_seeds(nt.Role.TARGET)),
    "nvme-host": (lambda d: fuzz_nvme(d, nt.Role.HOST), lambda: nvme_seeds(nt.Role.HOST)),
    "nvme-data": (fuzz_data, data_seeds),
}


def write_seeds(target: str, directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    seeds = TARGETS[target][1]()
    for i, seed in enumerate(seeds):
        TARGETS[target][0](seed)  # every seed must pass its own harness
        (directory / f"seed-{i:03d}").write_bytes(seed)
    return len(seeds)


def main(argv: list[str]) -> None:
    if argv[1:2] == ["--seeds"]:
        print(write_seeds(argv[2], Path(argv[3])))
        return
    harness = TARGETS[argv[1]][0]
    atheris.Setup([argv[0], *argv[2:]], harness)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
