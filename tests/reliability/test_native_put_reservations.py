"""A put reserves arena slots only for the values whose bytes are arriving: a PutMany header
that declares many large values and sends nothing must not pin (and evict the cache for) all
of them. Found with the live fuzzer's slow-payload worker (bench/fuzz/): 1.5 KB of header
evicted a 200 MiB working set and pinned 240 MiB for the frame timeout."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import cast

import pytest

from kvoffload.bench.fuzz import fuzz_bench as fuzz
from kvoffload.client_sdk import Client
from kvoffload.wire.native.connection import (
    NEED_DATA,
    ConnectionClosed,
    Event,
    Get,
    GetResult,
    Hello,
    NativeConnection,
    PayloadEnd,
    PutMany,
    PutManyDone,
    Role,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

VALUE = 4 << 20
BATCH = 12  # 48 MiB declared (a 4 MiB value takes a slab of its own), in a 128 MiB arena
GOOD = 80  # 1 MiB values the good client stores first


def _used(client: Client) -> int:
    """Bytes of DRAM slots in use: stored values and reservations."""
    tiers = cast(list[dict[str, int]], client.stats().store["tiers"])
    return tiers[0]["used_bytes"]


def _eventually(check: Callable[[], bool], limit: float = 30.0) -> bool:
    end = time.monotonic() + limit
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


class _Raw:
    """A native connection over a blocking socket, for frames the SDK would never split."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.conn = NativeConnection(Role.CLIENT)
        self.sock.sendall(self.conn.send(Hello(1)))
        assert self.events(1)

    def events(self, n: int) -> list[object]:
        out: list[object] = []
        while sum(isinstance(e, Event) for e in out) < n or not self.conn.at_frame_boundary:
            data = self.sock.recv(1 << 20)
            self.conn.receive_data(data)
            while (event := self.conn.next_event()) is not NEED_DATA:
                out.append(event)
                if isinstance(event, ConnectionClosed):
                    return out
        return out


def test_a_batch_header_pins_one_value_not_all_it_declares() -> None:
    with (
        fuzz.daemon(dram="128MiB") as daemon,
        Client.connect(f"kv://127.0.0.1:{daemon.ports['native']}") as good,
    ):
        keys = [os.urandom(16) for _ in range(GOOD)]
        for key in keys:
            good.put(key, os.urandom(1 << 20))
        raw = _Raw(daemon.ports["native"])
        batch = [os.urandom(16) for _ in range(BATCH)]
        values = [os.urandom(VALUE) for _ in range(BATCH)]
        parts = raw.conn.send_parts(PutMany(2, tuple(batch), (VALUE,) * BATCH), values)
        before = _used(good)
        raw.sock.sendall(parts[0])  # the header only
        # Reserving (and evicting for it) is one step of the daemon's loop, as is a stats call.
        assert _eventually(lambda: _used(good) != before), "the header was never taken"
        held = _used(good) - before
        assert held < 2 * VALUE, f"{held >> 20} MiB reserved for a header"
        kept = sum(good.get(key) is not None for key in keys)
        assert kept >= GOOD * 3 // 4, f"a header without payload evicted {GOOD - kept} values"

        # The values then arrive and are stored whole, in order.
        for part in parts[1:]:
            raw.sock.sendall(part)
        assert [e for e in raw.events(1) if isinstance(e, Event)] == [PutManyDone(2)]
        for i in (0, BATCH // 2, BATCH - 1):
            raw.sock.sendall(raw.conn.send(Get(3 + i, batch[i])))
            got = raw.events(1)
            assert got[0] == GetResult(3 + i, VALUE)
            assert isinstance(got[1], PayloadEnd) and got[1].data == values[i]


def test_a_batch_cut_off_midway_leaves_nothing_pinned_or_visible() -> None:
    with (
        fuzz.daemon(dram="128MiB") as daemon,
        Client.connect(f"kv://127.0.0.1:{daemon.ports['native']}") as good,
    ):
        raw = _Raw(daemon.ports["native"])
        before = _used(good)
        batch = [os.urandom(16) for _ in range(4)]
        values = [os.urandom(VALUE) for _ in range(4)]
        parts = raw.conn.send_parts(PutMany(2, tuple(batch), (VALUE,) * 4, (), False), values)
        raw.sock.sendall(b"".join([bytes(parts[0]), values[0], values[1][:1000]]))
        assert _eventually(lambda: _used(good) >= before + 2 * VALUE), "no second slot"
        raw.sock.close()
        assert _eventually(lambda: _used(good) == before), "reservations outlived the connection"
        assert not any(good.exists(key) for key in batch)


def test_a_put_of_empty_values_in_a_batch_is_stored() -> None:
    with fuzz.daemon(dram="64MiB") as daemon:
        raw = _Raw(daemon.ports["native"])
        keys = tuple(os.urandom(16) for _ in range(5))
        lengths = (0, 3, 0, 5, 0)
        raw.sock.sendall(raw.conn.send(PutMany(2, keys, lengths), [b"abc", b"defgh"]))
        assert [e for e in raw.events(1) if isinstance(e, Event)] == [PutManyDone(2)]
        for i, (key, length) in enumerate(zip(keys, lengths, strict=True)):
            raw.sock.sendall(raw.conn.send(Get(10 + i, key)))
            assert raw.events(1)[0] == GetResult(10 + i, length)
