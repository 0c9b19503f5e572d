"""Channel reads: the fd stays registered between reads, and unread data cannot spin the loop."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from kvoffload.errors import TransportError
from kvoffload.nvmeof_target.channel import Channel


def _loops() -> list[Any]:
    loops: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:
        return loops
    return [*loops, pytest.param(uvloop.new_event_loop, id="uvloop")]


LOOPS = pytest.mark.parametrize("new_loop", _loops())


def _run(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
    test: Callable[[asyncio.AbstractEventLoop, Channel, socket.socket], Coroutine[Any, Any, None]],
) -> None:
    loop = new_loop()
    ours, peer = socket.socketpair()
    try:
        channel = Channel(ours, loop)
        loop.run_until_complete(asyncio.wait_for(test(loop, channel, peer), 10))
        channel.close()
    finally:
        peer.close()
        ours.close()
        loop.close()


class _Counting:
    """Counts `add_reader`/`remove_reader` calls and reader callbacks on a loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.adds = self.removes = self.callbacks = 0
        add, remove = loop.add_reader, loop.remove_reader

        def add_reader(fd: int, callback: Callable[[], None]) -> None:
            def counted() -> None:
                self.callbacks += 1
                callback()

            self.adds += 1
            add(fd, counted)

        def remove_reader(fd: int) -> bool:
            self.removes += 1
            return remove(fd)

        loop.add_reader = add_reader  # type: ignore[method-assign,assignment]
        loop.remove_reader = remove_reader  # type: ignore[method-assign]


@LOOPS
def test_reads_keep_the_reader_registered(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def test(loop: asyncio.AbstractEventLoop, channel: Channel, peer: socket.socket) -> None:
        counts = _Counting(loop)
        buf = memoryview(bytearray(64))
        for i in range(20):  # request/reply: every read first finds the socket empty
            loop.call_later(0.001, peer.send, bytes([i]) * 3)
            assert await channel.recv_into(buf) == 3 and bytes(buf[:3]) == bytes([i]) * 3
        assert counts.adds == 1 and counts.removes == 0
        peer.shutdown(socket.SHUT_WR)
        assert await channel.recv_into(buf) == 0

    _run(new_loop, test)


@LOOPS
def test_unread_data_with_no_reader_waiting_does_not_spin(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def test(loop: asyncio.AbstractEventLoop, channel: Channel, peer: socket.socket) -> None:
        counts = _Counting(loop)
        buf = memoryview(bytearray(64))
        loop.call_later(0.001, peer.send, b"a")
        assert await channel.recv_into(buf) == 1
        peer.send(b"bc")  # arrives while nobody reads (a busy or paused session)
        await asyncio.sleep(0.2)
        assert counts.callbacks <= 2 and counts.removes == 1  # unregistered, not spinning
        assert await channel.recv_into(buf) == 2 and bytes(buf[:2]) == b"bc"
        loop.call_later(0.001, peer.send, b"d")
        assert await channel.recv_into(buf) == 1 and bytes(buf[:1]) == b"d"
        assert counts.adds == 2

    _run(new_loop, test)


@LOOPS
def test_a_cancelled_read_then_data_does_not_spin_and_reading_resumes(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def test(loop: asyncio.AbstractEventLoop, channel: Channel, peer: socket.socket) -> None:
        counts = _Counting(loop)
        buf = memoryview(bytearray(64))
        reader = asyncio.ensure_future(channel.recv_into(buf))
        await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        peer.send(b"xy")
        await asyncio.sleep(0.2)
        assert counts.callbacks <= 2 and counts.removes == 1
        assert await channel.recv_into(buf) == 2

    _run(new_loop, test)


@LOOPS
def test_close_wakes_a_waiting_reader_with_an_error(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def test(loop: asyncio.AbstractEventLoop, channel: Channel, peer: socket.socket) -> None:
        reader = asyncio.ensure_future(channel.recv_into(memoryview(bytearray(8))))
        await asyncio.sleep(0.01)
        channel.close()
        with pytest.raises(TransportError, match="closed"):
            await reader
        with pytest.raises(TransportError, match="closed"):
            await channel.recv_into(memoryview(bytearray(8)))

    _run(new_loop, test)


@LOOPS
def test_a_reset_reaches_a_waiting_reader(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def test(loop: asyncio.AbstractEventLoop, channel: Channel, peer: socket.socket) -> None:
        ours, other = socket.create_server(("127.0.0.1", 0)), socket.socket()
        try:
            other.connect(ours.getsockname())
            conn, _ = ours.accept()
            tcp = Channel(conn, loop)
            reader = asyncio.ensure_future(tcp.recv_into(memoryview(bytearray(8))))
            await asyncio.sleep(0.01)
            other.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            other.close()  # RST
            with pytest.raises(TransportError, match="connection lost"):
                await reader
            assert tcp.closed and tcp.error is not None
        finally:
            other.close()
            ours.close()

    _run(new_loop, test)


@LOOPS
def test_writes_go_out_whole_and_in_order_and_on_done_runs_once_sent(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    # A write with nothing queued is sent at once: all of it (on_done runs before write
    # returns) or what the kernel takes, the rest queued behind it for later writes to follow.
    async def test(loop: asyncio.AbstractEventLoop, channel: Channel, peer: socket.socket) -> None:
        done: list[str] = []
        channel.write([b"head", memoryview(b"small")], lambda: done.append("small"))
        assert done == ["small"] and not channel.buffered
        big = bytes(range(256)) * (16 << 10)  # 4 MiB: more than a socket pair buffers
        channel.write([b"", memoryview(big)[:3], memoryview(big)[3:]], lambda: done.append("big"))
        channel.write([b"tail"], lambda: done.append("tail"))
        assert channel.buffered and done == ["small"]  # the kernel took only part of it
        got = bytearray()
        want = len(b"headsmall") + len(big) + len(b"tail")
        peer.setblocking(False)
        while len(got) < want:
            try:
                got += peer.recv(1 << 20)
            except BlockingIOError:
                await asyncio.sleep(0.001)
        await channel.drain()
        assert bytes(got) == b"headsmall" + big + b"tail"
        assert done == ["small", "big", "tail"] and not channel.buffered

    _run(new_loop, test)


@LOOPS
def test_a_failed_write_runs_its_on_done(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def test(loop: asyncio.AbstractEventLoop, channel: Channel, peer: socket.socket) -> None:
        peer.close()
        done: list[int] = []
        for _ in range(3):  # the first may still reach the kernel; a later one fails
            channel.write([b"x" * 100_000], lambda: done.append(1))
        assert len(done) == 3 and channel.error is not None and channel.closed

    _run(new_loop, test)


@LOOPS
def test_waits_counts_only_reads_that_found_the_socket_empty(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """A session's turn (`Session._next_step`) ends when a read had to wait: a peer that keeps
    its socket full reads without waiting (no new turn: it yields after its share), a
    request/reply client waits each time (a new turn: never made to yield mid-request)."""

    async def test(loop: asyncio.AbstractEventLoop, channel: Channel, peer: socket.socket) -> None:
        buffer = memoryview(bytearray(4))
        peer.sendall(b"x" * 12)
        for _ in range(3):  # data already there: no wait
            assert await channel.recv_into(buffer) == 4
        assert channel.waits == 0
        loop.call_later(0.01, peer.sendall, b"y")  # empty now: the read waits for this
        assert await channel.recv_into(buffer) == 1
        assert channel.waits == 1

    _run(new_loop, test)


@LOOPS
def test_the_fd_is_offered_for_direct_sends_only_while_nothing_is_queued(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def test(loop: asyncio.AbstractEventLoop, channel: Channel, peer: socket.socket) -> None:
        assert channel.direct_fd() == channel.sock.fileno()
        channel.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        peer.setblocking(False)
        channel.write([bytes(1 << 20)])  # more than the socket takes: the rest is queued
        assert channel.buffered and channel.direct_fd() == -1  # a direct send would reorder
        got = 0
        while got < 1 << 20:
            got += len(await loop.sock_recv(peer, 1 << 20))
        await channel.drain()
        assert channel.direct_fd() == channel.sock.fileno()
        channel.close()
        assert channel.direct_fd() == -1

    _run(new_loop, test)
