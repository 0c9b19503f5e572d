"""Native puts (Put, PutMany, a cluster's Repair) on the daemon: payload bytes straight into
engine reservations.

A value's slot is reserved only when its bytes are next in the stream; `payload_part` and
`payload_end` follow the codec's `SinkFull` / `PayloadEnd` events. With an SSD tier,
reserving (which may evict) runs on the I/O threads and the session's reader waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial

from kvoffload.errors import CapacityError, KVOffloadError
from kvoffload.nvmeof_target.events.publisher import stored_meta
from kvoffload.nvmeof_target.native.session import CPut, NativeSession, PendingPut
from kvoffload.wire.blockmeta import BlockMeta
from kvoffload.wire.native.connection import (
    Event,
    PayloadEnd,
    Put,
    PutDone,
    PutMany,
    PutManyDone,
    Repair,
    RepairDone,
    SinkFull,
)

__all__ = [
    "c_put_begin",
    "c_put_commit",
    "on_put",
    "on_put_many",
    "on_repair",
    "payload_end",
    "payload_part",
]


def on_put(s: NativeSession, event: Put) -> Awaitable[object] | None:
    items = [(event.key, event.length, event.parent, event.block_meta)]
    if not event.length or s.services.blocking_engine:
        return _begin_put(s, event, items)
    # The common put (DRAM only, one value with bytes): reserve and point the payload at the
    # slot now, without the general path's item search and reserve-then plumbing.
    pending = PendingPut(event, items, at=0)
    s.puts[event.request_id] = pending
    _reserve(s, pending, [0])
    _sink(s, pending)
    return None


def on_put_many(s: NativeSession, event: PutMany) -> Awaitable[object] | None:
    parents = event.parents or (None,) * len(event.keys)
    metas = event.block_metas or (None,) * len(event.keys)
    items = list(zip(event.keys, event.lengths, parents, metas, strict=True))
    return _begin_put(s, event, items)


def on_repair(s: NativeSession, event: Repair) -> Awaitable[object] | None:
    """A cluster's read-repair copy: a put that is committed only if the key is absent and
    has no tombstone (`Tombstones.commit_repair`); RepairDone says whether it was stored."""
    return _begin_put(s, event, [(event.key, event.length, event.parent, event.block_meta)])


def _begin_put(
    s: NativeSession,
    event: Put | PutMany | Repair,
    items: list[tuple[bytes, int, bytes | None, bytes | None]],
) -> Awaitable[object] | None:
    pending = PendingPut(event, items)
    if not event.payload_length:
        return _reserve_then(s, pending, pending.empty_items, _end_put)
    s.puts[event.request_id] = pending
    pending.at = pending.next_item()
    return _reserve_then(s, pending, [pending.at], _sink)


def payload_part(s: NativeSession, full: SinkFull) -> Awaitable[object] | None:
    """One value's bytes are in: reserve the next one's slot and receive into it."""
    pending = s.puts[full.request_id]
    pending.at = pending.next_item()
    return _reserve_then(s, pending, [pending.at], _sink)


def payload_end(s: NativeSession, end: PayloadEnd) -> Awaitable[object] | None:
    pending = s.puts.pop(end.request_id, None)
    if pending is None:
        return None
    request = pending.request
    if type(request) is Put and not request.durable and not s.services.blocking_engine:
        _commit_put(s, pending)  # its one value has bytes: no empty values left to reserve
        return None
    return _reserve_then(s, pending, pending.empty_items, _end_put)


def _commit_put(s: NativeSession, pending: PendingPut) -> None:
    """`_end_put` for one non-durable value on a DRAM-only engine: commit inline and answer
    without building the answer event (what `in_order` and `reply` would do, flattened)."""
    request = pending.request
    rid = request.request_id
    if pending.error is not None:
        s.fail(rid, pending.error)
        return
    assert isinstance(request, Put)
    events = s.services.events
    reservation = pending.reserved[0]
    engine_key = s.me.key(request.key)
    if events is not None:
        meta = pending.items[0][3]
        events.expect(engine_key, request.key, request.parent, s.me.name,
                      None if meta is None else BlockMeta.decode(meta))  # fmt: skip
    try:
        reservation.commit()
    except KVOffloadError as exc:
        s.fail(rid, exc)
        return
    finally:
        reservation.abort()  # a no-op once committed
        if events is not None:
            events.settle(engine_key)
    if not s.reply_put_done_hot(rid, request.length):
        s.bytes_in.inc(request.length)
        s.reply_put_done(rid)


def c_put_begin(
    s: NativeSession, request_id: int, key: bytes, length: int, parent: bytes | None
) -> tuple[memoryview, CPut] | None:
    """The C reader found a whole canonical Put header (non-durable, 1 byte or more) on a
    DRAM-only engine (`HotGets.take_puts`): reserve its slot as `on_put` and `_reserve` do;
    (the slot, what `c_put_commit` and `NativeSession.resume_c_put` need), or None once a
    refused reservation has been handed to the codec, which answers it as `on_put` would."""
    me, events = s.me, s.services.events
    t0 = time.perf_counter()
    meta = stored_meta(key, parent, None) if events is not None else None
    engine_parent = parent if s.shard is None else s.shard.own_parent(parent)  # as `_reserve`
    try:
        reservation = s.engine.reserve(
            me.key(key), length, parent=me.opt_key(engine_parent), tenant=me.name, meta=meta
        )
    except KVOffloadError as exc:
        # `on_put` after a failed `_reserve`: the frame is the codec's, its payload dropped,
        # and the error answered at its end. Not reserved again: a second try could evict.
        event = s.conn.next_event()
        assert isinstance(event, Put) and event.request_id == request_id
        s.started_put(request_id, t0)
        pending = PendingPut(event, [(key, length, parent, None)], at=0, error=exc)
        s.puts[request_id] = pending
        s.conn.discard_payload()
        s.answered_in_python()
        return None
    return reservation.buffer, (request_id, key, length, parent, meta, reservation, t0)


def c_put_commit(s: NativeSession, put: CPut) -> bool:
    """The C reader received the whole value of `put`: `_commit_put`'s commit. True: C
    answers it; False: it failed and was answered here (the codec first learns of the put)."""
    request_id, key, _, parent, meta, reservation, t0 = put
    events, me = s.services.events, s.me
    engine_key = me.key(key)
    if events is not None:
        events.expect(engine_key, key, parent, me.name,
                      None if meta is None else BlockMeta.decode(meta))  # fmt: skip
    try:
        reservation.commit()
    except KVOffloadError as exc:
        s.admit_c_put(put)
        s.fail(request_id, exc)
        s.answered_in_python()
        return False
    finally:
        reservation.abort()  # a no-op once committed
        if events is not None:
            events.settle(engine_key)
    return True


def _reserve_then(
    s: NativeSession,
    pending: PendingPut,
    items: list[int],
    then: Callable[[NativeSession, PendingPut], Awaitable[object] | None],
) -> Awaitable[object] | None:
    reserve = partial(_reserve, s, pending, items)
    if not s.services.blocking_engine:
        return then(s, reserve())
    return _reserve_off_loop(s, reserve, then)


async def _reserve_off_loop(
    s: NativeSession,
    reserve: Callable[[], PendingPut],
    then: Callable[[NativeSession, PendingPut], Awaitable[object] | None],
) -> None:
    # Reserving may evict, which writes blocks to the SSD: not on the loop. The payload that
    # follows has nowhere to go until it is done, so this connection's reader waits.
    waiting = then(s, await s.off_loop(reserve, PendingPut.abort))
    if waiting is not None:
        await waiting


def _reserve(s: NativeSession, pending: PendingPut, items: list[int]) -> PendingPut:
    """Reserve the slots of `items` (on any thread); a failure gives back every slot of the
    put not committed yet and is kept in `error`."""
    if pending.error is not None or not items:
        return pending
    me = s.me
    shard = s.services.shard
    events = s.services.events
    try:
        for i in items:
            key, length, parent, meta = pending.items[i]
            if events is not None:  # stored with the hashes a restarted daemon announces
                meta = stored_meta(key, parent, meta)
                pending.items[i] = (key, length, parent, meta)
            if shard:
                shard.check(key)
                parent = shard.own_parent(parent)
            reserve = partial(
                s.engine.reserve,
                me.key(key),
                length,
                parent=me.opt_key(parent),
                durable=pending.request.durable,
                tenant=me.name,
                meta=meta,
            )
            try:
                pending.reserved[i] = reserve()
            except CapacityError:
                # The batch's own received values pin the arena: commit them (in order, as
                # the engine's put_many would have by now) so that they can be evicted, then
                # try once more. A batch larger than DRAM then stores what fits.
                if not _commit_received(s, pending, before=i):
                    raise
                pending.reserved[i] = reserve()
    except KVOffloadError as exc:
        pending.abort()
        pending.error = exc
    return pending


def _commit_received(s: NativeSession, pending: PendingPut, *, before: int) -> bool:
    """Commit the reserved (so fully received) values of items before `before`, in order;
    False if there were none."""
    done = sorted(i for i in pending.reserved if i < before)
    if done:
        _commit(s, pending, done)
    return bool(done)


def _commit(s: NativeSession, pending: PendingPut, indices: list[int]) -> None:
    """Commit the reservations of `indices` in order (on any thread), announcing them to the
    KV events first; every one not committed is given back if one fails.

    Raises:
        KVOffloadError: from a commit (the values before it stay stored).
    """
    events, me = s.services.events, s.me
    keys = []
    for i in indices:
        key, _, parent, meta = pending.items[i]
        keys.append(me.key(key))
        if events is not None:
            events.expect(keys[-1], key, parent, me.name,
                          None if meta is None else BlockMeta.decode(meta))  # fmt: skip
    repair = isinstance(pending.request, Repair)
    try:
        for i, engine_key in zip(indices, keys, strict=True):
            taken = pending.reserved.pop(i)
            if repair:
                pending.stored = s.services.tombstones.commit_repair(engine_key, taken)
                if not pending.stored:
                    continue
            else:
                taken.commit()
            # Counted as each is stored: a batch that fails later keeps (and counts) these.
            s.bytes_in.inc(pending.items[i][1])
    finally:
        for i in indices:
            reservation = pending.reserved.pop(i, None)
            if reservation is not None:
                reservation.abort()
        if events is not None:
            for engine_key in keys:
                events.settle(engine_key)


def _sink(s: NativeSession, pending: PendingPut) -> None:
    """Receive the arriving value into its slot (or drop the rest after a failure)."""
    if pending.error is None:
        s.conn.set_payload_part([pending.reserved[pending.at].buffer])
    else:
        s.conn.discard_payload()


def _end_put(s: NativeSession, pending: PendingPut) -> Awaitable[object] | None:
    rid = pending.request.request_id
    if pending.error is not None:
        s.fail(rid, pending.error)
        return None
    request = pending.request
    # What is left: values committed early to make room (`_reserve`) are stored already.
    commit = partial(_commit, s, pending, sorted(pending.reserved))

    def done(_: None) -> None:
        answer: Event = (
            PutDone(rid)
            if isinstance(request, Put)
            else PutManyDone(rid)
            if isinstance(request, PutMany)
            else RepairDone(rid, pending.stored)  # known once `_commit` ran
        )
        s.reply(answer)  # `_commit` counted the bytes in

    if pending.request.durable:
        # A durable commit waits for the SSD and the journal: off the loop, and the reader
        # goes on meanwhile (a get pipelined behind it may miss it).
        s.offload_request(rid, commit, done)
        return None
    return s.in_order(commit, done, partial(s.fail, rid))
