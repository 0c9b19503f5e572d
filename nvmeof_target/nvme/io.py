"""The NVMe/TCP front's I/O commands: the Key Value command set (Store, Retrieve, Exist,
Delete, List) on the engine, as a handler table the queue dispatches on (see `nvme_admin`
for the handler shape).

A Store's value is received straight into the slot `Engine.reserve` hands out (from the
capsule, or fetched with one R2T); a Retrieve's C2HData is sent from the pinned `BlockView`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvoffload.errors import KVOffloadError
from kvoffload.kvstore import BlockView, PutReservation
from kvoffload.nvmeof_target.nvme.queue import Handler, NvmeQueue
from kvoffload.nvmeof_target.nvme.subsys import (
    CommandFailed,
    NvmeNamespace,
    invalid_field,
    no_data,
    read_length,
    write_sgl,
)
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.cmd import (
    KEY_MAX,
    Command,
    Completion,
    KvOpc,
    Sc,
    Sct,
    StoreOption,
    kv_key,
)
from kvoffload.wire.nvme_tcp.connection import R2T

__all__ = ["IO"]

_CONDITIONS = StoreOption.ONLY_IF_EXISTS | StoreOption.ONLY_IF_ABSENT
# Store options -> the engine's `if_stored` condition for the commit (both: refused earlier).
_IF_STORED: dict[int, bool] = {StoreOption.ONLY_IF_EXISTS: True, StoreOption.ONLY_IF_ABSENT: False}


def _condition_failed(*, present: bool) -> CommandFailed:
    if present:
        return CommandFailed(Sct.GENERIC, Sc.KV_KEY_EXISTS, "key exists")
    return CommandFailed(Sct.GENERIC, Sc.KV_KEY_NOT_EXISTS, "key does not exist")


def _status(sct: int, sc: int, *, dnr: bool = True) -> int:
    return Completion.encode_status(sct, sc, dnr=dnr)


_MISS = _status(Sct.GENERIC, Sc.KV_KEY_NOT_EXISTS)


@dataclass(frozen=True)
class _Store:
    """A KV Store command whose value is on its way."""

    cid: int
    ns: NvmeNamespace
    key: bytes
    engine_key: bytes
    options: int
    in_capsule: bool


def _kv_namespace(
    q: NvmeQueue, cmd: Command, *, empty_key: bool = False
) -> tuple[NvmeNamespace, bytes]:
    ns = q.controller.namespace(cmd.nsid)
    kl = cmd.cdw11 & 0xFF
    if not (0 if empty_key else 1) <= kl <= KEY_MAX:
        raise CommandFailed(Sct.GENERIC, Sc.KV_INVALID_KEY_SIZE, f"key length {kl}")
    return ns, kv_key(cmd)


def _kv_store(q: NvmeQueue, cmd: Command, data_length: int) -> Awaitable[object] | None:
    ns, key = _kv_namespace(q, cmd)
    options = (cmd.cdw11 >> 8) & 0xFF  # bits 7:3 are reserved: ignored
    both = StoreOption.ONLY_IF_EXISTS | StoreOption.ONLY_IF_ABSENT
    if options & both == both:  # contradictory, not reserved
        raise invalid_field(f"store options {options:#x}")
    sgl = cmd.sgl
    in_capsule = write_sgl(cmd, data_length)
    length = cmd.cdw10
    if length != sgl.length or length > q.engine.max_value_bytes:
        raise CommandFailed(Sct.GENERIC, Sc.KV_INVALID_VALUE_SIZE, f"value size {length}")
    engine_key = ns.engine_key(key)
    _check_options(q, options, engine_key)
    reserve = functools.partial(q.engine.reserve, engine_key, length, tenant=ns.tenant.name)
    store = _Store(cmd.cid, ns, key, engine_key, options, in_capsule)
    if not q.services.blocking_engine:
        return _store_data(q, store, reserve())
    return _reserve_off_loop(q, store, reserve, data_length)


async def _reserve_off_loop(
    q: NvmeQueue, store: _Store, reserve: Callable[[], PutReservation], data_length: int
) -> None:
    # Reserving may evict, which writes blocks to the SSD: not on the loop. The data that
    # follows has nowhere to go until it is done, so this queue's reader waits.
    try:
        reservation = await q.off_loop(reserve, PutReservation.abort)
    except KVOffloadError as exc:
        q.refuse(store.cid, exc, data_length)
        return
    waiting = _store_data(q, store, reservation)
    if waiting is not None:
        await waiting


def _store_data(
    q: NvmeQueue, store: _Store, reservation: PutReservation
) -> Awaitable[object] | None:
    """Receive a Store's value into its reservation (asking for it with R2T if it is not in
    the capsule), then commit."""
    finish = functools.partial(_store_done, q, store, reservation)
    length = len(reservation)
    if length == 0:
        return finish(True)
    cmd_cid, in_capsule = store.cid, store.in_capsule
    q.receive(
        cmd_cid,
        reservation.buffer,
        length,
        finish,
        in_capsule=in_capsule,
        cleanup=reservation.abort,
    )
    if not in_capsule:
        # One R2T for the whole value; the host splits it at MAXH2CDATA.
        q.channel.write(q.conn.send_parts(R2T(cmd_cid, q.next_ttag(), 0, length)))
    return None


def _check_options(q: NvmeQueue, options: int, engine_key: bytes) -> None:
    if_stored = _IF_STORED.get(options & _CONDITIONS)
    if if_stored is not None and q.engine.contains(engine_key) != if_stored:
        raise _condition_failed(present=not if_stored)


def _store_done(
    q: NvmeQueue, store: _Store, reservation: PutReservation, ok: bool
) -> Awaitable[object] | None:
    if not ok:
        reservation.abort()
        q.complete(store.cid, _status(Sct.GENERIC, Sc.DATA_TRANSFER_ERROR, dnr=False))
        return None

    events = q.services.events
    if events is not None:
        events.expect(store.engine_key, store.ns.block_key(store.key), None, store.ns.tenant.name)

    def commit() -> None:
        # Checked again by the engine, atomically with the publish: with an SSD tier this
        # runs on an I/O thread, and another connection's store or delete of the key could
        # land between a separate check and the commit.
        if_stored = _IF_STORED.get(store.options & _CONDITIONS)
        try:
            if not reservation.commit(if_stored=if_stored):
                raise _condition_failed(present=not if_stored)
        finally:
            reservation.abort()  # no-op once committed
            if events is not None:
                events.settle(store.engine_key)

    def done(_: None) -> None:
        store.ns.directory.add(store.key, store.engine_key)
        q.bytes_in.inc(len(reservation))
        q.complete(store.cid)

    return q.in_order(commit, done, functools.partial(q.refuse, store.cid, data_length=0))


def _kv_retrieve(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    ns, key = _kv_namespace(q, cmd)
    limit = min(read_length(cmd, data_length), cmd.cdw10)
    engine_key = ns.engine_key(key)

    def send(view: BlockView | None) -> None:
        if view is None:
            q.complete(cmd.cid, _MISS)
            return
        n = min(len(view), limit)
        q.bytes_out.inc(n)
        # DW0 is the whole value's size: a host whose buffer was short asks again.
        q.complete(cmd.cid, dw0=len(view), data=view.data[:n], on_done=view.release)

    q.read_then(cmd.cid, lambda: q.engine.get(engine_key), send)


def _kv_exist(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    ns, key = _kv_namespace(q, cmd)
    no_data(data_length)
    q.complete(cmd.cid, 0 if q.engine.contains(ns.engine_key(key)) else _MISS)


def _kv_delete(q: NvmeQueue, cmd: Command, data_length: int) -> Awaitable[object] | None:
    ns, key = _kv_namespace(q, cmd)
    no_data(data_length)
    engine_key = ns.engine_key(key)
    q.services.tombstones.deleting(engine_key)  # before the engine: see `Tombstones`

    def done(deleted: bool) -> None:
        ns.directory.remove(key)
        if deleted and q.services.events is not None:
            q.services.events.removed(engine_key)
        q.complete(cmd.cid, 0 if deleted else _MISS)

    # With an SSD tier a delete wipes the block's slot header: in_order takes it off the loop.
    return q.in_order(
        functools.partial(q.engine.delete, engine_key),
        done,
        functools.partial(q.refuse, cmd.cid, data_length=0),
    )


def _kv_list(q: NvmeQueue, cmd: Command, data_length: int) -> None:
    ns, start = _kv_namespace(q, cmd, empty_key=True)
    limit = min(read_length(cmd, data_length), cmd.cdw10)
    if limit < 4:
        raise invalid_field("a List buffer holds at least the 4-byte key count")
    keys: list[bytes] = []
    gone: list[bytes] = []
    room = limit - 4
    for key, engine_key in ns.directory.from_key(start):
        entry = (2 + len(key) + 3) // 4 * 4
        if entry > room:
            break
        if q.engine.contains(engine_key):
            keys.append(key)
            room -= entry
        else:
            gone.append(key)  # evicted since it was stored
    for key in gone:
        ns.directory.remove(key)
    data, count = nd.pack_list_data(keys, limit)
    q.complete(cmd.cid, dw0=count, data=data)


# Key Value commands by opcode (on I/O queues).
IO: dict[int, Handler] = {
    KvOpc.STORE: _kv_store,
    KvOpc.RETRIEVE: _kv_retrieve,
    KvOpc.EXIST: _kv_exist,
    KvOpc.DELETE: _kv_delete,
    KvOpc.LIST: _kv_list,
}
