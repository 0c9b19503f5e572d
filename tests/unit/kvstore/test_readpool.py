"""The batch read pool: runs what was submitted, before and through a shutdown, and refuses
work after it (as ThreadPoolExecutor does, which the engine reports as a closed engine)."""

from __future__ import annotations

import threading

import pytest

from kvoffload.kvstore.mover import ReadPool


def test_shutdown_runs_what_was_submitted_then_refuses_more() -> None:
    pool = ReadPool(2, "test-read")
    gate = threading.Event()
    ran: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        assert gate.wait(30)
        with lock:
            ran.append(i)

    for i in range(6):  # 2 running, 4 queued behind them
        pool.submit(work, i)
    gate.set()
    pool.shutdown(wait=True)
    assert sorted(ran) == list(range(6))
    with pytest.raises(RuntimeError):
        pool.submit(work, 7)


def test_a_call_that_raises_does_not_stop_its_thread(caplog: pytest.LogCaptureFixture) -> None:
    pool = ReadPool(1, "test-read")
    done = threading.Event()

    def fail() -> None:
        raise OSError("injected")

    pool.submit(fail)
    pool.submit(done.set)
    assert done.wait(30)
    pool.shutdown()
    assert "injected" in caplog.text
