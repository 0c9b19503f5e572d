"""Wire status codes <-> exceptions: one table, used by the daemon to answer and by the SDK to
raise (the shape of redis-py's ``EXCEPTION_CLASSES``).

A miss is not a status: it is an ordinary answer (``found: false``, no length).
"""

from __future__ import annotations

import enum

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

__all__ = ["Status", "error_for", "status_of"]


class Status(enum.IntEnum):
    """Why a request failed. Values are stable: they travel on the wire."""

    OK = 0
    INVALID_ARGUMENT = 1
    CAPACITY = 2
    AUTH = 3
    PROTOCOL = 4
    STORAGE_IO = 5
    CORRUPT = 6
    DEADLINE = 7
    UNAVAILABLE = 8  # shutting down, too many connections: try again elsewhere or later
    CONFIG = 9
    INTERNAL = 10  # any other KVOffloadError on the server


# Exception class -> status, most specific first (checked in order, so subclasses win).
_STATUS_OF: tuple[tuple[type[KVOffloadError], Status], ...] = (
    (InvalidArgumentError, Status.INVALID_ARGUMENT),
    (CapacityError, Status.CAPACITY),
    (AuthError, Status.AUTH),
    (RemoteProtocolError, Status.PROTOCOL),
    (StorageIOError, Status.STORAGE_IO),
    (CorruptBlockError, Status.CORRUPT),
    (DeadlineExceededError, Status.DEADLINE),
    (TransportError, Status.UNAVAILABLE),
    (ConfigError, Status.CONFIG),
)

# Status -> the exception the SDK raises. A protocol status means *the client* broke the
# protocol in the server's eyes, which on the client side is a peer-reported failure: it is
# surfaced as RemoteProtocolError all the same, since the client cannot tell which side erred.
_ERROR_FOR: dict[int, type[KVOffloadError]] = {
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.CAPACITY: CapacityError,
    Status.AUTH: AuthError,
    Status.PROTOCOL: RemoteProtocolError,
    Status.STORAGE_IO: StorageIOError,
    Status.CORRUPT: CorruptBlockError,
    Status.DEADLINE: DeadlineExceededError,
    Status.UNAVAILABLE: TransportError,
    Status.CONFIG: ConfigError,
    Status.INTERNAL: KVOffloadError,
}


def status_of(exc: KVOffloadError) -> Status:
    """The status that reports `exc` to a peer (INTERNAL for anything unlisted)."""
    for cls, status in _STATUS_OF:
        if isinstance(exc, cls):
            return status
    return Status.INTERNAL


def error_for(status: int, message: str) -> KVOffloadError:
    """The exception to raise for a status received from a peer (unknown codes: INTERNAL)."""
    cls = _ERROR_FOR.get(status, KVOffloadError)
    return cls(message)
