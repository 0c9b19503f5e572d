"""The sync `kv://` client's lookup as one C call (`net_lookup`) against the Python codec, the
reference, through a real daemon and a scripted peer: the same answers for chains of 0, 1,
1,000, 4,096 (the C limit) and 4,097 keys, duplicates, misses part-way and bad keys, and the
same errors for answers the real daemon never sends; the C call is the one taken where it
applies."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvoffload.client_sdk import Client
from kvoffload.wire import fast
from kvoffload.wire.native.connection import (
    ErrorReply,
    Event,
    Lookup,
    LookupResult,
    NativeConnection,
)
from kvoffload.wire.status import Status
from tests.conftest import Daemon
from tests.integration.test_client_bad_answers import peer
from tests.integration.test_native_one_call import outcome

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif("c" not in fast.available(), reason="the C extension is not built"),
]

Start = Callable[..., Daemon]


@contextmanager
def implementation(name: str) -> Iterator[list[int]]:
    """The client's codec functions in C or Python; the key counts of the C lookups made."""
    calls: list[int] = []
    previous = fast.use(name)
    real = fast.net_lookup

    def counted(fd: int, keys: Any, rid: int, timeout: float) -> Any:
        calls.append(len(keys))
        return real(fd, keys, rid, timeout)  # type: ignore[misc]

    if real is not None:
        fast.net_lookup = counted
    try:
        yield calls
    finally:
        fast.use(previous)


def chain(tag: int, n: int) -> list[bytes]:
    return [tag.to_bytes(2, "big") + i.to_bytes(14, "big") for i in range(n)]


def test_both_paths_answer_alike_through_a_daemon(start_daemon: Start) -> None:
    daemon = start_daemon("--dram", "256MiB")
    stored = chain(1, 3000)
    with Client.connect(daemon.url()) as client:
        client.put_many([(k, b"x") for k in stored], parents=[None, *stored[:-1]])
    missing = chain(2, 5000)
    cases: list[object] = [
        [],
        stored[:1],
        stored[:1000],
        stored,  # 3,000 of 3,000
        stored + missing[:1096],  # 4,096 keys: a miss part-way, the C limit
        stored + missing[:1097],  # 4,097 keys: over it, the plan's way
        missing[:1000],
        [stored[0]] * 1000,  # duplicates
        [*stored[:10], stored[5], *stored[10:20]],
        stored[:500] + [b"short"],  # a bad key: refused before anything is sent
        tuple(stored[:100]),
        "not a list",
    ]
    answers = {}
    for name in ("python", "c"):
        with implementation(name) as calls, Client.connect(daemon.url()) as client:
            answers[name] = [outcome(lambda k=keys: client.lookup(k)) for keys in cases]  # type: ignore[misc]
        if name == "c":  # every lookup of 1 to 4,096 good keys was one C call
            assert calls == [1, 1000, 3000, 4096, 1000, 1000, 21, 100]
        else:
            assert calls == []
    assert answers["c"] == answers["python"]
    assert [a[1] if a[0] == "ok" else a[1] for a in answers["c"]] == [  # type: ignore[index]
        0, 1, 1000, 3000, 3000, 3000, 0, 1000, 21, "InvalidArgumentError", 100,
        "InvalidArgumentError",
    ]  # fmt: skip


def _over(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
    assert isinstance(event, Lookup)
    return _joined(conn, LookupResult(event.request_id, len(event.keys) + 1)), False


def _tiers(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
    assert isinstance(event, Lookup)
    n = len(event.keys)  # a tier run nobody asked for: the codec reads it, C hands it over
    return _joined(conn, LookupResult(event.request_id, n, (1, n))), False


def _refused(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
    return _joined(
        conn, ErrorReply(event.request_id, Status.INVALID_ARGUMENT, "no lookups here")
    ), False


def _closed(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
    frame = _joined(conn, LookupResult(event.request_id, 1))
    return frame[:-2], True


def _joined(conn: NativeConnection, event: Event) -> bytes:
    return b"".join(bytes(p) for p in conn.send_parts(event))


@pytest.mark.parametrize(
    "answer", [_over, _tiers, _refused, _closed], ids=["over", "tiers", "error", "cut"]
)
@pytest.mark.parametrize("n", [1, 1000, 4096])
def test_bad_answers_end_alike_on_both_paths(answer: Any, n: int) -> None:
    keys = [os.urandom(16) for _ in range(n)]
    answers = {}
    with peer(answer) as port:
        url = f"kv://127.0.0.1:{port}?retries=0&timeout=5"
        for name in ("python", "c"):
            with implementation(name) as calls, Client.connect(url) as client:
                answers[name] = outcome(lambda: client.lookup(keys))  # noqa: B023
            assert calls == ([n] if name == "c" else [])
    assert answers["c"] == answers["python"]
    expected = {
        _over: "RemoteProtocolError",
        _tiers: n,
        _refused: "InvalidArgumentError",
        _closed: 0,  # unreachable: an engine recomputes
    }[answer]
    assert answers["c"][1] == expected  # type: ignore[index]


@pytest.mark.parametrize("raised", [ValueError, TypeError])
def test_a_signal_during_a_c_lookup_is_raised_not_resent(raised: type[Exception]) -> None:
    """A signal handler that raises ValueError or TypeError (net_lookup's own refusals of
    keys) while net_lookup waits for the answer: its exception comes out and the frame, sent
    already, is not sent again through the codec; the connection, whose answer is still on
    its way, serves nothing else: the next lookup gets its own count, not the stale one."""
    got_first = threading.Event()
    release = threading.Event()
    seen: list[int] = []

    def answer(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
        assert isinstance(event, Lookup)
        seen.append(len(event.keys))
        if len(seen) == 1:
            got_first.set()
            release.wait(10)  # the first answer comes only after the interrupt
        return _joined(conn, LookupResult(event.request_id, len(event.keys))), False

    fired: list[bool] = []

    def handler(signum: int, frame: object) -> None:
        if not fired:
            fired.append(True)
            raise raised("interrupted")

    finished = threading.Event()
    main = threading.get_ident()

    def interrupt() -> None:
        # Again until the lookup ends: one sent before C polls would not wake it.
        if got_first.wait(10):
            for _ in range(200):
                if finished.is_set():
                    return
                signal.pthread_kill(main, signal.SIGUSR1)
                finished.wait(0.05)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        with peer(answer) as port, implementation("c") as calls:
            url = f"kv://127.0.0.1:{port}?retries=0&timeout=5"
            with Client.connect(url) as client:
                kicker = threading.Thread(target=interrupt)
                kicker.start()
                try:
                    with pytest.raises(raised, match="interrupted"):
                        client.lookup(chain(3, 7))
                finally:
                    finished.set()
                    kicker.join()
                release.set()
                assert client.lookup(chain(4, 5)) == 5
            assert seen == [7, 5]  # the first frame was sent once
            assert calls[0] == 7
    finally:
        release.set()
        signal.signal(signal.SIGUSR1, previous)
