"""What `bench fuzz` sends: valid native frames and NVMe/TCP PDUs, and the mutations a broken
or hostile peer would make of them."""

import os
import random
import socket
import struct
from collections.abc import Callable

import msgpack

from kvoffload.wire.native import connection as nw
from kvoffload.wire.native.frames import FRAME
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp import connection as nt
from kvoffload.wire.nvme_tcp import data as nd

SUBNQN = "nqn.2026-11.io.kvoffload:store"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000f022"
CC_ENABLE = (6 << 16) | (4 << 20) | (6 << 4) | 1
SQSIZE = 7  # 0's based: 8 commands per queue, what a daemon with queue_depth >= 8 admits


# ---------------------------------------------------------------------------- native frames

KEYS = [bytes([i]) * 16 for i in range(1, 9)]


def native_corpus() -> list[bytes]:
    """Valid requests, as a client that said Hello sends them (request ids rewritten later)."""
    conn = nw.NativeConnection(nw.Role.CLIENT)
    conn.send(nw.Hello(1))
    requests: list[tuple[nw.Event, list[bytes]]] = [
        (nw.Put(2, KEYS[0], 100), [bytes(100)]),
        (nw.Put(3, KEYS[1], 5000, parent=KEYS[0]), [os.urandom(5000)]),
        (nw.Get(4, KEYS[0]), []),
        (nw.GetMany(5, tuple(KEYS)), []),
        (nw.PutMany(6, tuple(KEYS[:3]), (10, 20, 30), durable=False), [bytes(60)]),
        (nw.Exists(7, KEYS[2]), []),
        (nw.Delete(8, KEYS[3]), []),
        (nw.Lookup(9, tuple(KEYS)), []),
        (nw.Prefetch(10, tuple(KEYS)), []),
        (nw.Stats(11), []),
    ]
    return [conn.send(event, payload) for event, payload in requests]


def hello_frame() -> bytes:
    return nw.NativeConnection(nw.Role.CLIENT).send(nw.Hello(1, client="fuzz"))


def with_id(frame: bytes, rid: int) -> bytearray:
    out = bytearray(frame)
    struct.pack_into("<I", out, 8, rid)
    return out


def odd_meta(rng: random.Random) -> object:
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


def mutate_native(frame: bytearray, rng: random.Random, limits: tuple[int, int]) -> bytes:
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
            rng.choice(("key", "keys", "length", "lengths", "parents", "x")): odd_meta(rng)
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


def capsule(cmd: nc.Command, data: bytes = b"") -> bytes:
    hlen = nt.CH.size + nc.SQE.size
    pdo = hlen if data else 0
    return nt.CH.pack(nt.PduType.CAPSULE_CMD, 0, hlen, pdo, hlen + len(data)) + cmd.pack() + data


def h2c(cid: int, ttag: int, offset: int, data: bytes, last: bool = True) -> bytes:
    head = struct.pack("<HHII4x", cid, ttag, offset, len(data))
    plen = 24 + len(data)
    return nt.CH.pack(nt.PduType.H2C_DATA, 0x04 if last else 0, 24, 24, plen) + head + data


def nvme_corpus(rng: random.Random) -> list[bytes]:
    cid = rng.randrange(1, 0xFFFF)
    key = rng.choice(KEYS)
    return [
        capsule(nc.identify(cid, nd.Cns.CONTROLLER)),
        capsule(nc.identify(cid, nd.Cns.ACTIVE_NAMESPACES)),
        capsule(nc.identify(cid, nd.Cns.NAMESPACE, nsid=1, csi=1)),
        capsule(nc.get_log_page(cid, 2, 512)),
        capsule(nc.get_features(cid, 7)),
        capsule(nc.property_get(cid, 0, True)),
        capsule(nc.keep_alive(cid)),
        capsule(nc.kv_store(cid, 1, key, 64, in_capsule=True), os.urandom(64)),
        capsule(nc.kv_store(cid, 1, key, 8192, in_capsule=False)),
        capsule(nc.kv_retrieve(cid, 1, key, 4096)),
        capsule(nc.kv_exist(cid, 1, key)),
        capsule(nc.kv_delete(cid, 1, key)),
        capsule(nc.kv_list(cid, 1, b"", 4096)),
        h2c(cid, rng.randrange(0x10000), 0, os.urandom(rng.choice((1, 512, 4096)))),
    ]


def mutate_nvme(pdu: bytes, rng: random.Random) -> bytes:
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


def nvme_queue(sock: socket.socket, qid: int, cntlid: int) -> int | None:
    """ICReq and Fabrics Connect on a fresh socket; the controller id, or None if refused."""
    host = nt.NvmeTcpConnection(nt.Role.HOST)
    sock.sendall(host.send(nt.ICReq()))
    data = nd.ConnectData(bytes(16), cntlid, SUBNQN, HOSTNQN).pack()
    connect = nc.connect(1, qid, SQSIZE)
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
        sock.sendall(capsule(nc.property_set(2, 0x14, CC_ENABLE)))
    return answered.dw0 & 0xFFFF
