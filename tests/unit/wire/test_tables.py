"""The codecs' dispatch tables cover their protocols: a reader for every PDU type, a writer for
every event a role may send, and every role's receivable types in the state tables."""

from __future__ import annotations

from kvoffload.wire.native.connection import Event
from kvoffload.wire.native.events import _ANSWER, _BY_FRAME
from kvoffload.wire.nvme_tcp.connection import PduType, Role
from kvoffload.wire.nvme_tcp.readers import PARSERS
from kvoffload.wire.nvme_tcp.state import (
    _NOW,
    _ON_RECEIVE,
    _ON_SEND,
    _RECEIVABLE,
    _SENDABLE,
)
from kvoffload.wire.nvme_tcp.writers import WRITERS


def test_every_pdu_type_has_a_reader() -> None:
    assert set(PARSERS) == set(PduType)


def test_every_sendable_event_has_a_writer_of_its_type() -> None:
    sendable = _SENDABLE[Role.HOST] | _SENDABLE[Role.TARGET]
    assert set(WRITERS) == sendable
    assert {kind.TYPE for kind in sendable} == set(PduType)


def test_what_a_role_may_receive_now_it_may_receive_at_all() -> None:
    for (role, _), now in _NOW.items():
        assert now <= _RECEIVABLE[role]


def test_phase_changes_are_for_pdus_that_can_move() -> None:
    receivable = _RECEIVABLE[Role.HOST] | _RECEIVABLE[Role.TARGET]
    assert set(_ON_RECEIVE) <= receivable
    assert set(_ON_SEND) <= {kind.TYPE for kind in _SENDABLE[Role.HOST] | _SENDABLE[Role.TARGET]}


def test_every_native_request_and_answer_decodes() -> None:
    classes: set[type[Event]] = {*_ANSWER, *_ANSWER.values()}
    assert classes <= set(_BY_FRAME.values())
