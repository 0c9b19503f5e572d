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
