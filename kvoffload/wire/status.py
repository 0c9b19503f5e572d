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
    WrongShardError,
)
from kvoffload.wire.nvme_tcp.cmd import CmdSc, Completion, Sc, Sct

__all__ = ["Status", "error_for", "nvme_error_for", "nvme_status_of", "status_of"]


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
    WRONG_SHARD = 11  # a key sent to a worker that does not hold it (protocol 2)


# Exception class -> status, most specific first (checked in order, so subclasses win).
_STATUS_OF: tuple[tuple[type[KVOffloadError], Status], ...] = (
    (InvalidArgumentError, Status.INVALID_ARGUMENT),
    (WrongShardError, Status.WRONG_SHARD),
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
    Status.WRONG_SHARD: WrongShardError,
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


# ---------------------------------------------------------------------------- NVMe

# The NVMe/TCP front answers with NVMe status codes (SCT, SC) instead of `Status`. Exception ->
# (SCT, SC, DNR) the daemon answers with, most specific first. DNR is clear where a retry can
# succeed (full now, free later; a transient I/O or transport failure).
_NVME_STATUS_OF: tuple[tuple[type[KVOffloadError], tuple[int, int, bool]], ...] = (
    (InvalidArgumentError, (Sct.GENERIC, Sc.KV_INVALID_VALUE_SIZE, True)),
    (CapacityError, (Sct.GENERIC, Sc.CAPACITY_EXCEEDED, False)),
    (StorageIOError, (Sct.GENERIC, Sc.KV_UNRECOVERED, False)),
    (CorruptBlockError, (Sct.GENERIC, Sc.KV_UNRECOVERED, False)),
    (AuthError, (Sct.COMMAND_SPECIFIC, CmdSc.CONNECT_INVALID_HOST, True)),
    (RemoteProtocolError, (Sct.GENERIC, Sc.INVALID_FIELD, True)),
    (TransportError, (Sct.GENERIC, Sc.TRANSIENT_TRANSPORT, False)),
    (DeadlineExceededError, (Sct.GENERIC, Sc.TRANSIENT_TRANSPORT, False)),
)
_NVME_INTERNAL = (Sct.GENERIC, Sc.INTERNAL, False)

# (SCT, SC) -> the exception the SDK raises. "Key does not exist" (87h) is a miss and never
# reaches this table through the SDK's calls; it is listed for hosts that ask directly.
_NVME_ERROR_FOR: dict[tuple[int, int], type[KVOffloadError]] = {
    (Sct.GENERIC, Sc.INVALID_OPCODE): RemoteProtocolError,
    (Sct.GENERIC, Sc.INVALID_FIELD): RemoteProtocolError,
    (Sct.GENERIC, Sc.DATA_TRANSFER_ERROR): TransportError,
    (Sct.GENERIC, Sc.INTERNAL): KVOffloadError,
    (Sct.GENERIC, Sc.INVALID_NAMESPACE): ConfigError,  # no such namespace for this host
    (Sct.GENERIC, Sc.COMMAND_SEQUENCE): RemoteProtocolError,
    (Sct.GENERIC, Sc.SGL_LENGTH_INVALID): RemoteProtocolError,
    (Sct.GENERIC, Sc.SGL_TYPE_INVALID): RemoteProtocolError,
    (Sct.GENERIC, Sc.SGL_OFFSET_INVALID): RemoteProtocolError,
    (Sct.GENERIC, Sc.TRANSIENT_TRANSPORT): TransportError,
    (Sct.GENERIC, Sc.CAPACITY_EXCEEDED): CapacityError,
    (Sct.GENERIC, Sc.NAMESPACE_NOT_READY): TransportError,
    (Sct.GENERIC, Sc.KV_INVALID_VALUE_SIZE): InvalidArgumentError,
    (Sct.GENERIC, Sc.KV_INVALID_KEY_SIZE): InvalidArgumentError,
    (Sct.GENERIC, Sc.KV_KEY_NOT_EXISTS): KVOffloadError,
    (Sct.GENERIC, Sc.KV_UNRECOVERED): StorageIOError,
    (Sct.GENERIC, Sc.KV_KEY_EXISTS): KVOffloadError,
    (Sct.COMMAND_SPECIFIC, CmdSc.INVALID_LOG_PAGE): RemoteProtocolError,
    (Sct.COMMAND_SPECIFIC, CmdSc.CONNECT_INCOMPATIBLE_FORMAT): RemoteProtocolError,
    (Sct.COMMAND_SPECIFIC, CmdSc.CONNECT_CONTROLLER_BUSY): TransportError,
    (Sct.COMMAND_SPECIFIC, CmdSc.CONNECT_INVALID_PARAMETERS): ConfigError,
    (Sct.COMMAND_SPECIFIC, CmdSc.CONNECT_INVALID_HOST): AuthError,
}


def nvme_status_of(exc: KVOffloadError) -> int:
    """The raw CQE status field that reports `exc` (Internal Error for anything unlisted)."""
    sct: int
    sc: int
    sct, sc, dnr = _NVME_INTERNAL
    for cls, found in _NVME_STATUS_OF:
        if isinstance(exc, cls):
            sct, sc, dnr = found
            break
    return Completion.encode_status(sct, sc, dnr=dnr)


def nvme_error_for(status: int, message: str) -> KVOffloadError:
    """The exception to raise for a failed completion's raw status field."""
    sc, sct = (status >> 1) & 0xFF, (status >> 9) & 0x7
    cls = _NVME_ERROR_FOR.get((sct, sc), KVOffloadError)
    return cls(f"{message} (NVMe status SCT {sct:#x} SC {sc:#04x})")
