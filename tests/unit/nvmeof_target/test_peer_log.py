"""`PeerLog`: a front's per-connection log lines, at most a burst per window, the rest counted
and said with the next line of a later window (a clock the test moves, not a timed wait)."""

from __future__ import annotations

import logging

import pytest

from kvoffload.nvmeof_target.session import PeerLog


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_per_window_then_a_count_of_what_was_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    logger = logging.getLogger("kvoffload.test.peerlog")
    peer_log = PeerLog(logger, burst=3, window_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=logger.name):
        for i in range(10):
            clock.now += 0.5
            peer_log.info("protocol error from %s", i)
        assert [r.getMessage() for r in caplog.records] == [
            "protocol error from 0",
            "protocol error from 1",
            "protocol error from 2",
        ]
        assert peer_log.held == 7
        clock.now += 10.0
        peer_log.info("protocol error from %s", "late")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[3].startswith("7 more connection log lines held back in ")
    assert messages[4] == "protocol error from late"
    assert peer_log.held == 0


def test_quiet_windows_say_nothing_extra(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    logger = logging.getLogger("kvoffload.test.peerlog2")
    peer_log = PeerLog(logger, burst=2, window_s=1.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=logger.name):
        for i in range(4):
            clock.now += 5.0
            peer_log.info("closing %s", i)
    assert [r.getMessage() for r in caplog.records] == [f"closing {i}" for i in range(4)]
