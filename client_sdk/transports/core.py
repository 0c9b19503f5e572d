"""The skeleton every network transport shares, so that a transport module holds only its
session (how requests and answers meet on its wire) and its plans.

An operation is written once, as a *plan*: a generator that yields the requests it needs
(several at a time when they can be pipelined) and receives their calls, answered. A runner
drives a plan over one connection; `retrying` runs it again on a fresh connection when the
connection fails, with full-jitter backoff, within the operation's deadline.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

from kvoffload.errors import (
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    KVOffloadError,
    TransportError,
)

__all__ = [
    "RETRY_PARAMS",
    "AsyncRunner",
    "Endpoint",
    "Held",
    "Plan",
    "SyncRunner",
    "connect",
    "left",
    "lost",
    "one",
    "receive",
    "retrying",
    "retrying_async",
    "send_all",
    "too_small",
    "typed_params",
]

log = logging.getLogger(__name__)


class Call(Protocol):
    """What a runner needs of a call: whether its answer is in."""

    @property
    def done(self) -> bool: ...


R = TypeVar("R")  # a request a plan asks for
C = TypeVar("C", bound=Call)  # the call that carries it and its answer
T = TypeVar("T")
A = TypeVar("A")

# Yields the requests of one step, receives their calls (all done), returns the result.
Plan = Generator[list[R], list[C], T]


def one(request: R) -> Generator[list[R], list[C], C]:
    """The step of a plan that sends one request."""
    (call,) = yield [request]
    return call


@dataclass(frozen=True, slots=True)
class Held:
    """A block received into memory the transport allocated; nothing to release."""

    data: memoryview

    def release(self) -> None:
        pass


def too_small(size: int, block: int, which: str = "buffer") -> InvalidArgumentError:
    return InvalidArgumentError(f"{which} of {size} bytes is too small for a {block}-byte block")


# ---------------------------------------------------------------------------- endpoint and options

# URL parameters every network transport takes.
RETRY_PARAMS = {
    "timeout": "seconds per operation (default 30)",
    "connect_timeout": "seconds to connect (default 5)",
    "retries": "attempts after a failed one (default 3)",
    "backoff": "first retry delay in seconds (default 0.05)",
}


class Endpoint(Protocol):
    """Where a transport connects, and its deadline and retry policy."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def url(self) -> str: ...

    @property
    def timeout(self) -> float: ...

    @property
    def connect_timeout(self) -> float: ...

    @property
    def retries(self) -> int: ...

    @property
    def backoff(self) -> float: ...


def typed_params(
    scheme: str,
    params: dict[str, str],
    *,
    floats: Sequence[str] = (),
    ints: dict[str, str] | None = None,
    flags: Sequence[str] = (),
) -> dict[str, Any]:
    """The URL parameters named, converted: `floats`, `ints` (parameter -> option name) and
    0/1 `flags`; the others are left to the caller.

    Raises:
        ConfigError: a value that does not convert.
    """
    out: dict[str, Any] = {}
    try:
        for name in floats:
            if name in params:
                out[name] = float(params[name])
        for name, dest in (ints or {}).items():
            if name in params:
                out[dest] = int(params[name])
    except ValueError as exc:
        raise ConfigError(f"bad {scheme} parameter: {exc}") from None
    for name in flags:
        if name in params:
            if params[name] not in ("0", "1"):
                raise ConfigError(f"{name} must be 0 or 1, got {params[name]!r}")
            out[name] = params[name] == "1"
    return out


# ---------------------------------------------------------------------------- deadlines, retries


def left(deadline: float) -> float:
    """Seconds until `deadline`.

    Raises:
        DeadlineExceededError: it has passed.
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceededError("operation timed out")
    return remaining


def _delays(endpoint: Endpoint, deadline: float) -> Iterator[float]:
    delay = endpoint.backoff
    for _ in range(endpoint.retries):
        # Full jitter: many clients of one restarting daemon do not retry in lockstep.
        wait = random.uniform(0, delay)
        if time.monotonic() + wait >= deadline:
            return
        yield wait
        delay = min(delay * 2, 2.0)


def retrying(
    endpoint: Endpoint,
    attempt: Callable[[A, float], T],
    arg: A,
    deadline: float | None = None,
    failed: TransportError | None = None,
) -> T:
    """`attempt(arg, deadline)` again after each `TransportError` while the retries and the
    operation's deadline last (every operation is idempotent).

    A caller that already made the first attempt itself (a transport's fast path) passes its
    `deadline` and the error it `failed` with: that attempt counts as the first.
    """
    if deadline is None:
        deadline = time.monotonic() + endpoint.timeout
    delays = _delays(endpoint, deadline)
    error = failed
    while True:
        if error is not None:
            wait = next(delays, None)
            if wait is None:
                raise error
            log.debug("retrying after %s", error)
            time.sleep(wait)
        try:
            return attempt(arg, deadline)
        except TransportError as exc:
            error = exc


async def retrying_async(
    endpoint: Endpoint, attempt: Callable[[A, float], Awaitable[T]], arg: A
) -> T:
    """`retrying` for a coroutine."""
    deadline = time.monotonic() + endpoint.timeout
    delays = _delays(endpoint, deadline)
    while True:
        try:
            return await attempt(arg, deadline)
        except TransportError as exc:
            wait = next(delays, None)
            if wait is None:
                raise
            log.debug("retrying after %s", exc)
            await asyncio.sleep(wait)


# ---------------------------------------------------------------------------- sockets


def connect(endpoint: Endpoint, deadline: float) -> socket.socket:
    """A blocking TCP connection to the endpoint, Nagle off.

    Raises:
        TransportError, DeadlineExceededError: it could not be reached in time.
    """
    try:
        sock = socket.create_connection(
            (endpoint.host, endpoint.port), timeout=min(endpoint.connect_timeout, left(deadline))
        )
    except TimeoutError:
        raise DeadlineExceededError(f"connecting to {endpoint.url} timed out") from None
    except OSError as exc:
        raise TransportError(f"cannot reach {endpoint.url}: {exc.strerror or exc}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def lost(url: str, exc: OSError) -> KVOffloadError:
    """The error for a connection whose socket call failed (a timeout is the deadline)."""
    if isinstance(exc, TimeoutError):
        return DeadlineExceededError(f"{url} did not answer in time")
    return TransportError(f"connection to {url} lost: {exc}")


class Receiver(Protocol):
    """A sans-I/O codec's receive side."""

    def get_buffer(self) -> memoryview: ...

    def buffer_updated(self, nbytes: int) -> None: ...

    def receive_eof(self) -> None: ...


def receive(sock: socket.socket, codec: Receiver, timeout: float) -> None:
    """One `recv_into` the codec's buffer within `timeout` seconds (0: only what is there)."""
    sock.settimeout(timeout)
    n = sock.recv_into(codec.get_buffer())
    if n:
        codec.buffer_updated(n)
    else:
        codec.receive_eof()


def send_all(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """`sendmsg` every byte of `parts` (a blocking socket; its timeout applies per call)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views[:512])  # Linux takes at most IOV_MAX (1024) buffers
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


# ---------------------------------------------------------------------------- runners


class SyncRunner(ABC, Generic[R, C]):
    """Drives plans over one blocking connection: a step's requests go out with as many in
    flight as the connection has room for, then the step waits for all their answers."""

    def run(self, plan: Plan[R, C, T], deadline: float) -> T:
        try:
            requests = next(plan)
            while True:
                requests = plan.send(self.exchange(requests, deadline))
        except StopIteration as stop:
            return cast(T, stop.value)

    def exchange(self, requests: Sequence[R], deadline: float) -> list[C]:
        """Send `requests` and collect their calls, all done."""
        calls: list[C] = []
        for request in requests:
            while not self.room(calls):
                self.pump(deadline)
            calls.append(self.start(request, deadline))
        while not all(c.done for c in calls):
            self.pump(deadline)
        return calls

    @abstractmethod
    def room(self, calls: list[C]) -> bool:
        """Whether another request may go out now (`calls`: the step's so far)."""

    @abstractmethod
    def start(self, request: R, deadline: float) -> C:
        """Send `request`; its call, not done yet."""

    @abstractmethod
    def pump(self, deadline: float) -> None:
        """Receive once and handle what arrived (marking calls done)."""


class AsyncRunner(ABC, Generic[R, C]):
    """Drives plans over one asyncio connection that any number of tasks share."""

    async def run(self, plan: Plan[R, C, T], deadline: float) -> T:
        try:
            requests = next(plan)
            while True:
                requests = plan.send(await self.exchange(requests, deadline))
        except StopIteration as stop:
            return cast(T, stop.value)

    @abstractmethod
    async def exchange(self, requests: list[R], deadline: float) -> list[C]:
        """Send `requests` and collect their calls, all done."""
