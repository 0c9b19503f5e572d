"""The one exception hierarchy of kvoffload; every package may import this module.

A miss is never an error: lookups return ``None``/``False``/``0``. These exceptions mean a caller
bug, bad configuration, a broken peer or a resource that is exhausted.
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "CapacityError",
    "CodecError",
    "CodecMismatchError",
    "ConfigError",
    "CorruptBlockError",
    "CorruptEncodedError",
    "DeadlineExceededError",
    "InvalidArgumentError",
    "KVOffloadError",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "StorageIOError",
    "TransportError",
    "WrongShardError",
    "UnsupportedCodecConfigError",
]


class KVOffloadError(Exception):
    """Root of every error kvoffload raises on purpose."""


class InvalidArgumentError(KVOffloadError, ValueError):
    """A caller passed something unusable (wrong key length, negative size, value too large).

    The call changed nothing; the message says what to fix.
    """


class ConfigError(KVOffloadError):
    """A configuration value, file, URL or environment variable is wrong or unknown."""


class ProtocolError(KVOffloadError):
    """Base of protocol violations; never raised directly."""


class LocalProtocolError(ProtocolError):
    """We were about to send something the protocol does not allow (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes the protocol does not allow."""


class AuthError(KVOffloadError):
    """Authentication or authorisation failed (bad token, host NQN not allowed)."""


class TransportError(KVOffloadError):
    """The connection to a store failed or was lost (not the built-in ``ConnectionError``)."""


class WrongShardError(KVOffloadError):
    """A key reached a worker of a multi-worker daemon that does not hold it: the client's map
    of the node's shards is out of date (the node restarted with another worker count)."""


class CapacityError(KVOffloadError):
    """The store cannot place a value: everything evictable is pinned, or a quota is exhausted."""


class StorageIOError(KVOffloadError):
    """A device or file operation failed (EIO, ENOSPC); the failed operation changed nothing."""


class CorruptBlockError(KVOffloadError):
    """A stored block failed its integrity check. Reads turn this into a counted miss."""


class DeadlineExceededError(KVOffloadError):
    """An operation did not finish in time (not the built-in ``TimeoutError``)."""


class CodecError(KVOffloadError):
    """A codec could not encode or decode a block; the only errors `kvoffload.compression`
    raises. Reads from a store turn them into counted misses."""


class CodecMismatchError(CodecError, InvalidArgumentError):
    """Data, block spec and buffer do not fit together: a value that is not one block of the
    namespace, a dtype the namespace does not declare, an output buffer of the wrong size."""


class CorruptEncodedError(CodecError):
    """An encoded payload is malformed: truncated, an unknown format version, lengths that do
    not add up, a compressed stream the decompressor rejects."""


class UnsupportedCodecConfigError(CodecError):
    """A codec name, id, option or dtype that this build does not support; the message lists
    what is supported."""
