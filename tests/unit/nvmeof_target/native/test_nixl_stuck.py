"""A NIXL transfer the daemon cannot cancel: the client frees its buffer once the connection
answers or closes, so the daemon must do neither while the transfer may still land there.
Driven with a scripted agent (a real UCX transfer cannot be made to refuse its release)."""

from __future__ import annotations

import asyncio
import select
import socket
import time
import types
from typing import Any

import pytest

import kvoffload.nvmeof_target.native.nixl as daemon_nixl


class _StuckHandle:
    def release(self) -> None:
        raise RuntimeError("cannot cancel")


class _List:
    """A prepared descriptor list; counts its releases."""

    released = 0

    def release(self) -> None:
        _List.released += 1


class _StuckAgent:
    """A NIXL agent whose transfer stays in progress and cannot be released."""

    def initialize_xfer(self, *_: Any) -> _StuckHandle:
        return _StuckHandle()

    def prep_xfer_dlist(self, *_: Any) -> _List:
        return _List()

    def make_prepped_xfer(self, *_: Any) -> _StuckHandle:
        return _StuckHandle()

    def remove_remote_agent(self, _: str) -> None:
        return None

    def get_xfer_descs(self, *_: Any) -> None:
        return None

    def transfer(self, _: Any) -> str:
        return "PROC"

    def check_xfer_state(self, _: Any) -> str:
        return "PROC"


def test_a_stuck_transfer_is_neither_answered_nor_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = object.__new__(daemon_nixl.NixlAgent)
    agent._agent = _StuckAgent()  # type: ignore[assignment]
    agent.errors = (RuntimeError,)
    agent.quarantine = []
    agent._lists = {}
    agent.names = {"client"}
    ours, client = socket.socketpair()
    answers: list[object] = []

    def abort() -> None:  # what the session's abort does to the channel
        answers.append("abort")
        ours.close()

    session = types.SimpleNamespace(
        version=daemon_nixl.AUTH_VERSION,
        nixl=types.SimpleNamespace(proven=True),  # its worker proven (issue 27)
        peer="client",
        fail=lambda request, exc: answers.append(("answer", request, str(exc))),
        end_after_answers=lambda: answers.append("end"),
        abort=abort,
    )

    async def the_agent(_: object) -> daemon_nixl.NixlAgent:
        return agent

    monkeypatch.setattr(daemon_nixl, "_agent", the_agent)

    async def work(a: daemon_nixl.NixlAgent, _: object) -> None:
        deadline = time.monotonic() + 0.05
        await a.move("WRITE", [(0x1000, 64)], [(0x2000, 64)], "client", deadline, ["held"], ours)

    try:
        asyncio.run(daemon_nixl._run(session, 7, work))  # type: ignore[arg-type]
        assert answers == ["abort"]  # no answer sent
        assert len(agent.quarantine) == 1  # the arena memory stays held
        # ... and the prepared lists the transfer was made from: never released, not even
        # when the connection forgets the client's agent.
        agent.forget("client")
        assert _List.released == 0
        # The daemon's own descriptor is closed, yet the client sees no close: nothing to read.
        assert ours.fileno() == -1
        assert select.select([client], [], [], 0.2)[0] == []
    finally:
        for _, fd in agent.quarantine:  # type: ignore[misc]
            if fd >= 0:
                socket.socket(fileno=fd).close()
        client.close()
