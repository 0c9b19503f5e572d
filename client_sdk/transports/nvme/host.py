"""One association with an NVMe/TCP KV controller, and its commands by name."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

from kvoffload.client_sdk.transports.core import left, one
from kvoffload.client_sdk.transports.nvme.bringup import (
    ADMIN_DEPTH,
    CC_CONFIG,
    CC_CSS_ALL,
    CC_EN,
    bring_up,
)
from kvoffload.client_sdk.transports.nvme.options import NvmeOptions
from kvoffload.client_sdk.transports.nvme.plans import keyed, store
from kvoffload.client_sdk.transports.nvme.queue import Call, Cmd, Plan, Queue, views
from kvoffload.errors import DeadlineExceededError, KVOffloadError, TransportError
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.nvme_tcp.cmd import Command, Completion

__all__ = ["NvmeHost"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_CC_SHN_NORMAL = 0x1 << 14
_CSTS_SHST_MASK, _CSTS_SHST_DONE = 0xC, 0x8


class NvmeHost:
    """One association with an NVMe/TCP KV controller: an admin queue, `options.queues` I/O
    queues, Keep Alive in the background. Thread-safe; no retries (see `NvmeTransport`).

    Raises (constructor):
        TransportError, DeadlineExceededError: the target could not be reached.
        AuthError: the target refused this host NQN (Connect "Invalid Host").
        ConfigError: no such subsystem, no KV namespace, or a parameter the target refused.
        RemoteProtocolError: the target answered in a way a standard host would refuse.
    """

    def __init__(self, options: NvmeOptions) -> None:
        self.options = options
        deadline = time.monotonic() + max(options.connect_timeout, 1.0) * 2
        self._admin_lock = threading.Lock()
        self._cond = threading.Condition()
        self._idle: list[Queue] = []
        self._io: list[Queue] = []
        self._closed = False
        self.broken: KVOffloadError | None = None
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self.admin = Queue(options, 0, ADMIN_DEPTH, deadline)
        try:
            up = bring_up(options, self.admin, self._io, deadline)
        except BaseException:
            self._close_sockets()
            raise
        self.cntlid, self.version, self.controller = up.cntlid, up.version, up.controller
        self.kato_ms, self.nsid, self.namespace = up.kato_ms, up.nsid, up.namespace
        self.in_capsule = up.in_capsule
        self._idle = list(self._io)
        if self.kato_ms:
            self._keeper = threading.Thread(
                target=self._keep_alive, name="kvoffload-nvme-keepalive", daemon=True
            )
            self._keeper.start()

    # ------------------------------------------------------------------ running commands

    def run(self, plan: Plan[T], deadline: float) -> T:
        """Run a plan on an idle I/O queue.

        Raises:
            TransportError, DeadlineExceededError: the queue failed (the association is then
                closed: every queue of it is unusable).
        """
        queue = self._acquire(deadline)
        ok = False
        try:
            result = queue.run(plan, deadline)
            ok = True
            return result
        except (TransportError, DeadlineExceededError) as exc:
            self._break(exc)
            raise
        finally:
            self._release(queue, ok)

    def admin_command(
        self, make: Callable[[int], Command], deadline: float | None = None
    ) -> tuple[Completion, bytes]:
        """Run one admin command; returns its completion and the data it read."""
        deadline = deadline or time.monotonic() + self.options.timeout
        with self._admin_lock:
            try:
                call = self.admin.run(one(Cmd(make)), deadline)
            except (TransportError, DeadlineExceededError) as exc:
                self._break(exc)
                raise
        return call.result(), bytes(call.read_data()) if call.chunks else b""

    def io_command(
        self,
        make: Callable[[int], Command],
        data: Sequence[object] = (),
        deadline: float | None = None,
    ) -> tuple[Completion, bytes]:
        """Run one I/O command as built by `make(cid)`, sending `data` (in the capsule if its
        SGL says so, else on R2T); returns its completion and the data it read."""
        deadline = deadline or time.monotonic() + self.options.timeout
        call = self.run(one(Cmd(make, views(data))), deadline)
        return call.result(), bytes(call.read_data()) if call.chunks else b""

    def _acquire(self, deadline: float) -> Queue:
        with self._cond:
            while True:
                if self.broken is not None:
                    raise self.broken
                if self._closed:
                    raise TransportError("the NVMe/TCP host is closed")
                if self._idle:
                    return self._idle.pop()
                if not self._cond.wait(timeout=left(deadline)):
                    raise DeadlineExceededError(f"no free I/O queue to {self.options.url}")

    def _release(self, queue: Queue, ok: bool) -> None:
        with self._cond:
            if queue.broken is None:
                self._idle.append(queue)
            self._cond.notify()

    def _break(self, error: KVOffloadError) -> None:
        with self._cond:
            if self.broken is None:
                self.broken = (
                    error if isinstance(error, TransportError) else TransportError(str(error))
                )
            self._cond.notify_all()
        self._close_sockets()

    def _keep_alive(self) -> None:
        # Well inside KATO: the target tears the association down after KATO of silence.
        period = max(0.05, self.kato_ms / 1000 / 3)
        while not self._stop.wait(period):
            try:
                self.admin_command(nc.keep_alive, time.monotonic() + max(period, 1.0))
            except KVOffloadError as exc:
                log.warning("keep-alive to %s failed: %s", self.options.url, exc)
                return

    # ------------------------------------------------------------------ KV commands

    def store(
        self,
        key: bytes,
        parts: Sequence[object],
        *,
        options: int = 0,
        deadline: float | None = None,
    ) -> Completion:
        """KV Store of the concatenation of `parts` (in the capsule or by R2T, by size)."""
        deadline = deadline or time.monotonic() + self.options.timeout
        call: Call = self.run(
            one(store(self.nsid, key, views(parts), self.in_capsule, options)), deadline
        )
        return call.result()

    def retrieve(
        self, key: bytes, size: int, deadline: float | None = None
    ) -> tuple[Completion, bytes]:
        """KV Retrieve into a `size`-byte host buffer: (completion, the bytes sent)."""
        deadline = deadline or time.monotonic() + self.options.timeout
        make = partial(keyed, fn=nc.kv_retrieve, nsid=self.nsid, key=key, buffer_size=size)
        call = self.run(one(Cmd(make)), deadline)
        return call.result(), bytes(call.read_data()) if call.chunks else b""

    def exist(self, key: bytes, deadline: float | None = None) -> Completion:
        return self._simple(nc.kv_exist, key, deadline)

    def delete(self, key: bytes, deadline: float | None = None) -> Completion:
        return self._simple(nc.kv_delete, key, deadline)

    def list(
        self, start: bytes = b"", size: int = 4096, deadline: float | None = None
    ) -> tuple[Completion, list[bytes]]:
        """KV List from `start` (b"": from the beginning) into a `size`-byte buffer."""
        deadline = deadline or time.monotonic() + self.options.timeout
        make = partial(keyed, fn=nc.kv_list, nsid=self.nsid, key=start, buffer_size=size)
        call = self.run(one(Cmd(make)), deadline)
        c = call.result()
        return c, nd.list_data(call.read_data()) if c.ok and call.chunks else []

    def _simple(self, fn: Callable[..., Command], key: bytes, deadline: float | None) -> Completion:
        deadline = deadline or time.monotonic() + self.options.timeout
        make = partial(keyed, fn=fn, nsid=self.nsid, key=key)
        return self.run(one(Cmd(make)), deadline).result()

    # ------------------------------------------------------------------ closing

    def close(self, timeout: float = 2.0) -> None:
        """Shut the controller down (CC.SHN, wait for CSTS.SHST) and close every queue."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._stop.set()
        if self.broken is None:
            deadline = time.monotonic() + timeout
            with contextlib.suppress(KVOffloadError):
                cc = CC_CONFIG | CC_CSS_ALL | CC_EN | _CC_SHN_NORMAL
                self.admin_command(partial(nc.property_set, offset=0x14, value=cc), deadline)
                while time.monotonic() < deadline:
                    c, _ = self.admin_command(
                        partial(nc.property_get, offset=0x1C, eight=False), deadline
                    )
                    if c.dw0 & _CSTS_SHST_MASK == _CSTS_SHST_DONE:
                        break
                    time.sleep(0.01)
        self._close_sockets()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(timeout=timeout)

    def _close_sockets(self) -> None:
        for queue in [self.admin, *self._io]:
            queue.close()
