"""The NVMe KV command set's operations, each written once as a plan (see `core`) that the
host runs on an I/O queue: KV Store, Retrieve (allocated or into the caller's buffer), Exist
and Delete, and the SDK's batch and lookup forms built from them."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from functools import partial

from kvoffload.client_sdk.transports.base import HeldBlock, IntoBuffer, PutItem, Received
from kvoffload.client_sdk.transports.core import Held, one, too_small
from kvoffload.client_sdk.transports.nvme.queue import Call, Cmd, Plan, views
from kvoffload.errors import RemoteProtocolError
from kvoffload.wire.block import HEADER_BYTES
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp.cmd import Command, Sc, Sct

__all__ = [
    "count",
    "delete",
    "exists",
    "exists_many",
    "get",
    "get_into",
    "get_many",
    "get_many_into",
    "keyed",
    "lookup",
    "miss",
    "put",
    "put_many",
    "store",
]

_KV_MISS_SCTS = (Sct.GENERIC, Sct.COMMAND_SPECIFIC)


def store(nsid: int, key: bytes, data: list[memoryview], in_capsule: int, options: int = 0) -> Cmd:
    """KV Store of `data`: in the capsule if it fits `in_capsule` bytes, else on R2T."""
    length = sum(len(v) for v in data)
    make = partial(
        _store_cmd, nsid=nsid, key=key, length=length, in_capsule=length <= in_capsule, opt=options
    )
    return Cmd(make, data)


def _store_cmd(
    cid: int, *, nsid: int, key: bytes, length: int, in_capsule: bool, opt: int
) -> Command:
    return nc.kv_store(cid, nsid, key, length, in_capsule=in_capsule, options=opt)


def keyed(cid: int, *, fn: Callable[..., Command], nsid: int, key: bytes, **kw: int) -> Command:
    return fn(cid, nsid, key, **kw)


def miss(call: Call) -> bool:
    # 87h "Key Does Not Exist": SCT 0 per SPDK, libnvme and this target; xNVMe's tests expect
    # SCT 1 for it [?], so either counts as a miss.
    return call.result().sc == Sc.KV_KEY_NOT_EXISTS and call.result().sct in _KV_MISS_SCTS


def _peek_length(header: memoryview) -> int | None:
    """The payload length a stored block's header claims (None if it is not one of ours)."""
    if len(header) < HEADER_BYTES or bytes(header[:4]) != b"KVOB":
        return None
    (stored,) = struct.unpack_from("<Q", header, 20)
    return int(stored)


def put(nsid: int, in_capsule: int, key: bytes, parts: Sequence[object]) -> Plan[None]:
    call: Call = yield from one(store(nsid, key, views(parts), in_capsule))
    call.ok("KV Store")


def put_many(nsid: int, in_capsule: int, items: Sequence[PutItem]) -> Plan[None]:
    calls = yield [store(nsid, key, views(parts), in_capsule) for key, parts, _, _ in items]
    for call in calls:  # the first failure in order is the one to report
        call.ok("KV Store")


def _retrieve(nsid: int, size: int, key: bytes) -> Cmd:
    return Cmd(partial(keyed, fn=nc.kv_retrieve, nsid=nsid, key=key, buffer_size=size))


def _held(call: Call) -> HeldBlock | None:
    if miss(call):
        return None
    c = call.ok("KV Retrieve")
    data = call.read_data() if call.chunks else memoryview(b"")
    if c.dw0 != len(data):  # the buffer was the namespace's largest value: never short
        raise RemoteProtocolError(f"Retrieve sent {len(data)} of a {c.dw0}-byte value")
    return Held(data)


def get(nsid: int, size: int, key: bytes) -> Plan[HeldBlock | None]:
    """KV Retrieve into a `size`-byte buffer (the namespace's largest value)."""
    call: Call = yield from one(_retrieve(nsid, size, key))
    return _held(call)


def get_many(nsid: int, size: int, keys: Sequence[bytes]) -> Plan[list[HeldBlock | None]]:
    calls = yield [_retrieve(nsid, size, k) for k in keys]
    return [_held(c) for c in calls]


def _retrieve_into(
    nsid: int, key: bytes, buffer: IntoBuffer
) -> tuple[Cmd, Callable[[Call], Received | None]]:
    """A KV Retrieve whose value lands in `buffer` (its header apart), and what reads its
    completion."""
    header = memoryview(bytearray(HEADER_BYTES))
    oversized = False

    def sink(offset: int, left: int) -> list[memoryview] | None:
        nonlocal oversized
        if offset < HEADER_BYTES:  # the block header first: it says how long the block is
            return [header[offset : min(HEADER_BYTES, offset + left)]]
        claimed = _peek_length(header)
        if claimed is not None and claimed > len(buffer):
            oversized = True  # drop the rest: nothing is written into the caller's buffer
        if oversized:
            return None
        start = offset - HEADER_BYTES
        return [buffer.region(start, start + left)]

    size = HEADER_BYTES + len(buffer)

    def result(call: Call) -> Received | None:
        if miss(call):
            return None
        c = call.ok("KV Retrieve")
        if oversized or c.dw0 > size:
            # (a block that is not one of ours may have written some bytes: the caller's
            # received_into clears them)
            raise too_small(len(buffer), c.dw0 - HEADER_BYTES)
        if c.dw0 < HEADER_BYTES:  # not one of ours: verification will say so
            return Received(header[: c.dw0], 0)
        return Received(header, c.dw0 - HEADER_BYTES)

    make = partial(keyed, fn=nc.kv_retrieve, nsid=nsid, key=key, buffer_size=size)
    return Cmd(make, sink=sink), result


def get_into(nsid: int, key: bytes, buffer: IntoBuffer) -> Plan[Received | None]:
    cmd, result = _retrieve_into(nsid, key, buffer)
    return result((yield from one(cmd)))


def get_many_into(
    nsid: int, keys: Sequence[bytes], buffers: Sequence[IntoBuffer]
) -> Plan[list[Received | None]]:
    """One Retrieve per key, all in flight together (queue depth permitting)."""
    retrievals = [_retrieve_into(nsid, k, b) for k, b in zip(keys, buffers, strict=True)]
    calls = yield [cmd for cmd, _ in retrievals]
    return [result(call) for (_, result), call in zip(retrievals, calls, strict=True)]


def exists(nsid: int, key: bytes) -> Plan[bool]:
    call: Call = yield from one(Cmd(partial(keyed, fn=nc.kv_exist, nsid=nsid, key=key)))
    if miss(call):
        return False
    call.ok("KV Exist")
    return True


def delete(nsid: int, key: bytes) -> Plan[bool]:
    call: Call = yield from one(Cmd(partial(keyed, fn=nc.kv_delete, nsid=nsid, key=key)))
    if miss(call):
        return False
    call.ok("KV Delete")
    return True


def lookup(nsid: int, keys: Sequence[bytes], window: int) -> Plan[int]:
    """Leading keys present: Exist commands pipelined a window at a time, stopping at a miss."""
    total = 0
    for i in range(0, len(keys), window):
        chunk = keys[i : i + window]
        calls = yield [Cmd(partial(keyed, fn=nc.kv_exist, nsid=nsid, key=k)) for k in chunk]
        for call in calls:
            if miss(call):
                return total
            call.ok("KV Exist")
            total += 1
    return total


def exists_many(nsid: int, keys: Sequence[bytes], window: int) -> Plan[list[bool]]:
    """Each key's presence: Exist commands pipelined a window at a time (a miss is False)."""
    out: list[bool] = []
    for i in range(0, len(keys), window):
        chunk = keys[i : i + window]
        calls = yield [Cmd(partial(keyed, fn=nc.kv_exist, nsid=nsid, key=k)) for k in chunk]
        for call in calls:
            found = not miss(call)
            if found:
                call.ok("KV Exist")
            out.append(found)
    return out


def count(nsid: int, keys: Sequence[bytes]) -> Plan[int]:
    calls = yield [Cmd(partial(keyed, fn=nc.kv_exist, nsid=nsid, key=k)) for k in keys]
    found = 0
    for call in calls:
        if not miss(call):
            call.ok("KV Exist")
            found += 1
    return found
