"""The transport core without sockets: URL parameters, the retry loop, the plan runner."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from kvoffload.client_sdk.transports.core import Plan, SyncRunner, one, retrying, typed_params
from kvoffload.errors import ConfigError, InvalidArgumentError, TransportError


@dataclass(frozen=True)
class _Endpoint:
    host: str = "h"
    port: int = 1
    url: str = "x://h:1"
    timeout: float = 5.0
    connect_timeout: float = 1.0
    retries: int = 2
    backoff: float = 0.0


def test_typed_params_convert_and_refuse() -> None:
    params = {"timeout": "1.5", "queues": "8", "kato": "10", "tls": "1", "other": "kept"}
    got = typed_params(
        "x://",
        params,
        floats=("timeout",),
        ints={"queues": "queues", "kato": "kato_ms"},
        flags=("tls",),
    )
    assert got == {"timeout": 1.5, "queues": 8, "kato_ms": 10, "tls": True}
    with pytest.raises(ConfigError, match="bad x:// parameter"):
        typed_params("x://", {"pool": "many"}, ints={"pool": "pool"})
    with pytest.raises(ConfigError, match="tls must be 0 or 1"):
        typed_params("x://", {"tls": "yes"}, flags=("tls",))


def test_retrying_retries_transport_errors_only() -> None:
    attempts: list[float] = []

    def flaky(fail: int, deadline: float) -> str:
        attempts.append(deadline)
        if len(attempts) <= fail:
            raise TransportError("lost")
        return "ok"

    assert retrying(_Endpoint(), flaky, 2) == "ok"
    assert len(attempts) == 3 and len(set(attempts)) == 1  # one deadline for the operation
    attempts.clear()
    with pytest.raises(TransportError):
        retrying(_Endpoint(), flaky, 3)  # the retries are spent
    assert len(attempts) == 3

    def refused(_: None, deadline: float) -> None:
        attempts.append(deadline)
        raise InvalidArgumentError("bad")

    attempts.clear()
    with pytest.raises(InvalidArgumentError):
        retrying(_Endpoint(), refused, None)
    assert len(attempts) == 1


def test_retrying_counts_a_failed_first_attempt() -> None:
    """A transport's fast path makes the first attempt itself: the retries that follow use
    its deadline and the failure it passes counts against the budget."""
    attempts: list[float] = []

    def flaky(fail: int, deadline: float) -> str:
        attempts.append(deadline)
        if len(attempts) < fail:
            raise TransportError("lost")
        return "ok"

    first = TransportError("fast path lost")
    deadline = time.monotonic() + 5.0
    assert retrying(_Endpoint(), flaky, 2, deadline, first) == "ok"
    assert attempts == [deadline, deadline]
    attempts.clear()
    with pytest.raises(TransportError, match="lost"):
        retrying(_Endpoint(), flaky, 3, deadline, first)  # 1 + the 2 retries are spent
    assert len(attempts) == 2
    attempts.clear()
    # No failure passed (a pooled connection the daemon had closed): the full budget is left.
    assert retrying(_Endpoint(), flaky, 3, deadline) == "ok"
    assert len(attempts) == 3


@dataclass
class _Call:
    request: int
    done: bool = False


@dataclass
class _Runner(SyncRunner[int, _Call]):
    """Answers requests in order, one per pump; at most `window` in flight."""

    window: int = 2
    flight: list[_Call] = field(default_factory=list)
    most: int = 0

    def room(self, calls: list[_Call]) -> bool:
        return len(self.flight) < self.window

    def start(self, request: int, deadline: float) -> _Call:
        call = _Call(request)
        self.flight.append(call)
        self.most = max(self.most, len(self.flight))
        return call

    def pump(self, deadline: float) -> None:
        self.flight.pop(0).done = True


def _plan() -> Plan[int, _Call, list[int]]:
    first = yield [1, 2, 3, 4, 5]
    last: _Call = yield from one(6)
    return [c.request for c in first] + [last.request]


def test_runner_pipelines_within_the_window() -> None:
    runner = _Runner()
    assert runner.run(_plan(), deadline=0.0) == [1, 2, 3, 4, 5, 6]
    assert runner.most == 2 and not runner.flight
