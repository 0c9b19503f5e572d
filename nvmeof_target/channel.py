"""A non-blocking socket on the event loop that moves bytes without extra copies.

asyncio's stream and protocol APIs copy: `writelines` joins its buffers (before 3.12) and queues
unsent bytes in a bytearray, so an arena view handed to them is copied, and nobody says when the
arena bytes may be reused. A `Channel` owns its socket instead, through the loop's
`add_reader`/`add_writer` (stock asyncio and uvloop alike): reads go through `recv_into` into
memory the caller picks (an engine reservation), writes through `sendmsg` straight from the
caller's buffers (pinned arena views), and each write's `on_done` runs once its last byte is in
the kernel, which is when a pinned view may be released.

`TlsChannel` layers TLS on the same interface with `ssl.SSLObject` and memory BIOs: decryption
writes straight into the caller's memory; encryption necessarily copies, once, and a write's
`on_done` runs once its ciphertext is in the kernel (so flow control sees what is queued).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import cast

from kvoffload.errors import TransportError

__all__ = ["Channel", "TlsChannel"]

# Buffers per sendmsg call; Linux refuses more than IOV_MAX (1024).
_IOV_BATCH = 512
_TLS_READ = 256 << 10


class Channel:
    """One connected, non-blocking stream socket."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._loop = loop
        self._fd = sock.fileno()
        # Unsent buffers in order, and (bytes still queued up to and including it, callback).
        self._out: collections.deque[memoryview] = collections.deque()
        self._done: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._queued = 0  # bytes in _out
        self._sent = 0  # bytes sent since the channel opened (for _done bookkeeping)
        # When the kernel last took bytes, or output was queued after none was waiting: while
        # `buffered`, how long the peer has kept us from sending.
        self.progress_at = time.monotonic()
        self._writing = False
        self._drained: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None  # a reader waiting for data
        self._reading = False  # the fd is registered with the loop for reading
        self.waits = 0  # reads that found the socket empty and waited (the loop went round)
        self.error: BaseException | None = None
        self.closed = False

    # ------------------------------------------------------------------ reading

    async def recv_into(self, buffer: memoryview) -> int:
        """Receive into `buffer`; 0 means the peer closed its side.

        Raises:
            TransportError: the connection broke or the channel was closed.
        """
        while True:
            self._check()
            try:
                return self.sock.recv_into(buffer)
            except (BlockingIOError, InterruptedError):
                await self._wait_readable()
            except OSError as exc:
                raise self._fail(exc) from None

    async def _wait_readable(self) -> None:
        # The fd stays registered between reads: a request/reply loop finds the socket empty on
        # every read, and registering and unregistering it each time costs epoll_ctl calls and
        # a loop wake-up per request. `_on_readable` unregisters it only when it fires with
        # nobody waiting (so unread data cannot make a level-triggered loop spin) and `close`.
        self.waits += 1
        if not self._reading:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)
        ready: asyncio.Future[None] = self._loop.create_future()
        self._waiter = ready
        try:
            await ready
        finally:
            self._waiter = None

    def _on_readable(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        elif waiter is None and self._reading and not self.closed:
            # Readable and no reader waiting (it is busy, paused or cancelled): stop watching
            # until the next read finds the socket empty.
            self._reading = False
            self._loop.remove_reader(self._fd)

    def watch(self, callback: Callable[[], object]) -> None:
        """Let `callback` be the loop's reader of the socket, in place of the channel's own,
        until `unwatch` (a reader callback in C: `NativeSession._read_in_c`)."""
        self._reading = False  # the registration is the callback's now
        self._loop.add_reader(self._fd, callback)

    def unwatch(self) -> None:
        """The channel's own reader again, registered with nobody waiting (as after a read):
        the loop swaps the callback of the fd it already watches."""
        if not self.closed:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)

    def broken(self, errno: int) -> TransportError:
        """A receive done outside `recv_into` failed with `errno`: as `recv_into` fails."""
        return self._fail(OSError(errno, os.strerror(errno)))

    # ------------------------------------------------------------------ writing

    @property
    def buffered(self) -> int:
        """Bytes accepted by `write` and not yet handed to the kernel."""
        return self._queued

    def write(
        self, parts: Sequence[bytes | memoryview], on_done: Callable[[], None] | None = None
    ) -> None:
        """Send `parts` in order after everything written before; never blocks.

        The buffers must stay unchanged until `on_done` runs (it also runs, at once, if the
        channel is or gets closed: the buffers are no longer used either way).
        """
        if self.closed or self.error is not None:
            if on_done is not None:
                on_done()
            return
        if not self._out:
            self.progress_at = time.monotonic()
            if not self._writing and len(parts) <= _IOV_BATCH:
                # Nothing queued: send at once, and queue only what the kernel did not take
                # (a request/reply loop then skips the queue and its bookkeeping).
                try:
                    sent = self.sock.sendmsg(parts)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as exc:
                    self._fail(exc)
                    if on_done is not None:
                        on_done()
                    return
                self._sent += sent
                parts = _unsent(parts, sent)
                if not parts:
                    if on_done is not None:
                        on_done()
                    return
        for part in parts:
            view = memoryview(part).cast("B")
            if len(view):
                self._out.append(view)
                self._queued += len(view)
        if on_done is not None:
            self._done.append((self._sent + self._queued, on_done))
        if not self._writing:
            self._flush()

    def direct_fd(self) -> int:
        """The socket's fd while a caller may send on it directly (nothing queued, no write
        pending, open), else -1. Bytes sent that way bypass `_sent`: with nothing queued no
        `on_done` waits on that count."""
        if self._out or self._writing or self.closed or self.error is not None:
            return -1
        return self._fd

    def _flush(self) -> None:
        while self._out:
            try:
                n = self.sock.sendmsg(list(_take(self._out, _IOV_BATCH)))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._fail(exc)
                return
            self._advance(n)
        self._complete()
        if self._out and not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._on_writable)
        elif not self._out and self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        if not self._out and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _on_writable(self) -> None:
        if not self.closed:
            self._flush()

    def _advance(self, n: int) -> None:
        if n:
            self.progress_at = time.monotonic()
        self._sent += n
        self._queued -= n
        while n:
            head = self._out[0]
            if len(head) <= n:
                n -= len(head)
                self._out.popleft()
            else:
                self._out[0] = head[n:]
                n = 0

    def _complete(self) -> None:
        while self._done and self._done[0][0] <= self._sent:
            self._done.popleft()[1]()

    async def drain(self) -> None:
        """Wait until every written byte is in the kernel.

        Raises:
            TransportError: the connection broke first.
        """
        self._check()
        if not self._out:
            return
        if self._drained is None or self._drained.done():
            self._drained = self._loop.create_future()
        await asyncio.shield(self._drained)
        self._check()

    # ------------------------------------------------------------------ closing

    def _check(self) -> None:
        if self.error is not None:
            raise TransportError(f"connection lost: {self.error}")
        if self.closed:
            raise TransportError("channel closed")

    def _fail(self, exc: BaseException) -> TransportError:
        self.error = exc
        self.close()
        return TransportError(f"connection lost: {exc}")

    def close(self) -> None:
        """Close the socket now; queued bytes are dropped and their callbacks run."""
        if self.closed:
            return
        self.closed = True
        if self._writing:
            self._loop.remove_writer(self._fd)
        self._reading = False
        self._loop.remove_reader(self._fd)
        self._out.clear()
        self._queued = 0
        done, self._done = self._done, collections.deque()
        for _, callback in done:
            callback()
        for future in (self._drained, self._waiter):
            if future is not None and not future.done():
                future.set_result(None)
        with contextlib.suppress(OSError):
            self.sock.close()


class TlsChannel(Channel):
    """A `Channel` speaking TLS (server side) through an `SSLObject`."""

    def __init__(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop, context: ssl.SSLContext
    ) -> None:
        super().__init__(sock, loop)
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._scratch = bytearray(_TLS_READ)

    async def handshake(self) -> None:
        """Complete the TLS handshake.

        Raises:
            TransportError: the peer went away or the handshake failed.
        """
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._push()
                await self._pull()
            except ssl.SSLError as exc:
                raise self._fail(exc) from None
        self._push()

    async def recv_into(self, buffer: memoryview) -> int:
        while True:
            self._check()
            try:
                return cast(int, self._tls.read(len(buffer), buffer))
            except ssl.SSLWantReadError:
                self._push()
                if not await self._pull():
                    return 0
            except ssl.SSLZeroReturnError:
                return 0
            except ssl.SSLError as exc:
                raise self._fail(exc) from None

    async def _pull(self) -> bool:
        """Move ciphertext from the socket into the TLS object; False at EOF."""
        n = await Channel.recv_into(self, memoryview(self._scratch))
        if n == 0:
            self._incoming.write_eof()
            return False
        self._incoming.write(memoryview(self._scratch)[:n])
        return True

    def write(
        self, parts: Sequence[bytes | memoryview], on_done: Callable[[], None] | None = None
    ) -> None:
        if not (self.closed or self.error is not None):
            try:
                for part in parts:
                    if len(part):
                        self._tls.write(part)
            except ssl.SSLError as exc:
                self._fail(exc)
        # The plaintext is copied into ciphertext already, but `on_done` waits until the
        # kernel has that ciphertext: callers count a write as in flight until `on_done`, and
        # a peer that stops reading must not make ciphertext pile up here without limit.
        self._push(on_done)

    def _push(self, on_done: Callable[[], None] | None = None) -> None:
        pending = self._outgoing.pending
        chunks = [self._outgoing.read(pending)] if pending and not self.closed else []
        if chunks or on_done is not None:
            Channel.write(self, chunks, on_done)


def _take(out: collections.deque[memoryview], n: int) -> list[memoryview]:
    if len(out) <= n:
        return list(out)
    return [out[i] for i in range(n)]


def _unsent(parts: Sequence[bytes | memoryview], n: int) -> list[memoryview]:
    """What is left of `parts` once their first `n` bytes are sent."""
    for i, part in enumerate(parts):
        size = part.nbytes if type(part) is memoryview else memoryview(part).nbytes
        if n < size:
            return [memoryview(part).cast("B")[n:], *(memoryview(p) for p in parts[i + 1 :])]
        n -= size
    return []
