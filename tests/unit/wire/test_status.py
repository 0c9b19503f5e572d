from __future__ import annotations

import pytest

from kvoffload.errors import (
    AuthError,
    CapacityError,
    ConfigError,
    CorruptBlockError,
    DeadlineExceededError,
    InvalidArgumentError,
    KVOffloadError,
    RemoteProtocolError,
    StorageIOError,
    TransportError,
)
from kvoffload.wire.status import Status, error_for, status_of


@pytest.mark.parametrize(
    "cls",
    [
        InvalidArgumentError,
        CapacityError,
        AuthError,
        RemoteProtocolError,
        StorageIOError,
        CorruptBlockError,
        DeadlineExceededError,
        TransportError,
        ConfigError,
    ],
)
def test_each_error_survives_the_wire(cls: type[KVOffloadError]) -> None:
    status = status_of(cls("why"))
    assert status not in (Status.OK, Status.INTERNAL)
    back = error_for(status, "why")
    assert type(back) is cls and str(back) == "why"


def test_unlisted_errors_and_codes_are_internal() -> None:
    assert status_of(KVOffloadError("x")) is Status.INTERNAL
    assert type(error_for(Status.INTERNAL, "x")) is KVOffloadError
    assert type(error_for(250, "from a newer server")) is KVOffloadError
