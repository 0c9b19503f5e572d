"""A read's answer may not pin the DRAM tier out from under writers (trust issue (e)).

A `get_many` answer keeps its blocks pinned until the kernel has taken their bytes; a client
that asks for many blocks and reads slowly (or never) held up to `native.max_payload_bytes` —
the whole tier here — and every put then failed with CapacityError.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest

from kvoffload.client_sdk import Client
from kvoffload.wire.native.connection import GetMany, Hello, NativeConnection, Role

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
Start = Callable[..., Any]
MIB = 1 << 20


def test_a_get_many_that_is_never_read_leaves_room_for_puts(start_daemon: Start) -> None:
    daemon = start_daemon("--dram", "64MiB")
    old = [i.to_bytes(16, "big") for i in range(40)]
    with Client.connect(daemon.url()) as writer:
        for key in old:
            writer.put(key, bytes([key[-1]]) * MIB)
        # A reader asks for every block in one answer and never reads it.
        conn = NativeConnection(Role.CLIENT)
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as stalled:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stalled.sendall(conn.send(Hello(1)) + conn.send(GetMany(2, tuple(old))))
            # Until the daemon has pinned what it will answer, a get of the last key is a hit
            # through the same engine: ask it, then put 40 new MiB that need evictions.
            assert writer.get(old[-1]) is not None
            new = [(100 + i).to_bytes(16, "big") for i in range(40)]
            for key in new:
                writer.put(key, b"n" * MIB)
            # The stalled answer pins at most a quarter of the tier (answer_pin_share): 40 new
            # MiB fit beside it. Before, it pinned all 40 old MiB, and the puts evicted each
            # other down to the 23 that fit in what was left.
            assert sum(writer.get(key) is not None for key in new) == len(new)


def test_stats_count_get_many_answers_cut_short_by_the_pin_budget(start_daemon: Start) -> None:
    # An SSD tier puts GetMany on the Python path, where the counters are kept (issue 30:
    # how often `bench lmcache-mp`'s loads are cut short).
    daemon = start_daemon("--dram", "64MiB", "--ssd", "128MiB")
    keys = [i.to_bytes(16, "big") for i in range(12)]
    with Client.connect(daemon.url()) as client:
        for key in keys:
            client.put(key, bytes([key[-1]]) * (2 * MIB))
        # 24 MiB in one batch, the budget a quarter of 64 MiB: one answer cut short, then the
        # rest; every block still comes back whole.
        got = client.get_many(keys)
        assert [g is not None and bytes(g) == bytes([k[-1]]) * (2 * MIB) for g, k in
                zip(got, keys, strict=True)] == [True] * len(keys)  # fmt: skip
        server = client.stats().store["server"]
    assert server["get_many_answers"] == 2, server
    assert server["get_many_cut"] == 1, server
    # The one read block that did not fit was read, then dropped unsent.
    assert server["get_many_dropped"] >= 1, server
