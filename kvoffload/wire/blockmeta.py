"""Per-block metadata a put may carry (token ids, the engine's block hashes, LoRA and salt) and
its compact byte form, the same on the native wire, in the engine and in the SSD journal.

A KV-aware router (Dynamo, llm-d) hashes a block's token ids itself; the store never sees
tokens otherwise, so the serving engine hands them over with the put. Token ids are prompt
content: see docs/guides/daemon.md (KV events) for how to keep them private.

Byte form, little-endian::

    u8  version (1)
    u8  flags: 1 block_hash, 2 parent_hash, 4 lora_name, 8 cache_salt
    u16 number of token ids
    u32 block_size (tokens the block covers; 0 = len(token_ids))
    u64 block_hash, u64 parent_hash (0 when absent)
    u8 length + UTF-8 lora_name, u8 length + UTF-8 cache_salt
    u32 token ids
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvoffload.errors import InvalidArgumentError, LocalProtocolError

__all__ = ["MAX_META_BYTES", "MAX_META_TOKENS", "MAX_NAME_BYTES", "BlockMeta"]

# An LMCache chunk is 256 tokens and a vLLM block 16; twice LMCache's chunk leaves room.
MAX_META_TOKENS = 512
MAX_NAME_BYTES = 128
_HEAD = struct.Struct("<BBHIQQ")
MAX_META_BYTES = _HEAD.size + 2 * (1 + MAX_NAME_BYTES) + 4 * MAX_META_TOKENS
_VERSION = 1
_HASH, _PARENT, _LORA, _SALT = 1, 2, 4, 8
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a KV-aware router needs to know about a stored block.

    Attributes:
        token_ids: the token ids the block covers (at most `MAX_META_TOKENS`, each < 2**32).
        block_hash: the serving engine's own hash of the block (64-bit; vLLM's hash reduced
            the way vLLM's events reduce it), published as the event's block hash.
        parent_hash: the same hash of the previous block of the chain.
        lora_name: the LoRA adapter the block was computed with.
        cache_salt: the request's cache salt (vLLM `cache_salt`), if any.
        block_size: tokens per block, when the block holds more than `token_ids` names
            (0: `len(token_ids)`).

    Raises:
        InvalidArgumentError: a field out of bounds (too many tokens, a hash that is not a
            64-bit unsigned integer, a name longer than `MAX_NAME_BYTES` UTF-8 bytes).
    """

    token_ids: tuple[int, ...] = ()
    block_hash: int | None = None
    parent_hash: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    block_size: int = 0

    def __post_init__(self) -> None:
        tokens = self.token_ids
        if not isinstance(tokens, tuple):
            try:
                tokens = tuple(int(t) for t in tokens)  # lists, numpy arrays, tensors' tolist()
            except (TypeError, ValueError):
                raise InvalidArgumentError("token_ids must be a sequence of integers") from None
            object.__setattr__(self, "token_ids", tokens)
        if len(tokens) > MAX_META_TOKENS:
            raise InvalidArgumentError(
                f"{len(tokens)} token ids exceed the limit of {MAX_META_TOKENS} per block"
            )
        if any(type(t) is not int or not 0 <= t <= _U32 for t in tokens):
            raise InvalidArgumentError("token ids must be integers in [0, 2**32)")
        for name in ("block_hash", "parent_hash"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or not 0 <= value <= _U64):
                raise InvalidArgumentError(f"{name} must be a 64-bit unsigned integer or None")
        for name in ("lora_name", "cache_salt"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, str) or len(value.encode()) > MAX_NAME_BYTES
            ):
                raise InvalidArgumentError(f"{name} must be a string of <= {MAX_NAME_BYTES} bytes")
        if type(self.block_size) is not int or not 0 <= self.block_size <= _U32:
            raise InvalidArgumentError("block_size must be a non-negative 32-bit integer")

    @property
    def tokens_per_block(self) -> int:
        return self.block_size or len(self.token_ids)

    def encode(self) -> bytes:
        """The byte form (at most `MAX_META_BYTES`)."""
        flags = ((_HASH if self.block_hash is not None else 0)
                 | (_PARENT if self.parent_hash is not None else 0)
                 | (_LORA if self.lora_name is not None else 0)
                 | (_SALT if self.cache_salt is not None else 0))  # fmt: skip
        lora = (self.lora_name or "").encode()
        salt = (self.cache_salt or "").encode()
        return b"".join((
            _HEAD.pack(_VERSION, flags, len(self.token_ids), self.block_size,
                       self.block_hash or 0, self.parent_hash or 0),
            bytes((len(lora),)), lora, bytes((len(salt),)), salt,
            struct.pack(f"<{len(self.token_ids)}I", *self.token_ids),
        ))  # fmt: skip

    @classmethod
    def decode(cls, data: bytes) -> BlockMeta:
        """Parse the byte form.

        Raises:
            LocalProtocolError: not a well-formed, in-bounds encoding (the wire layer reports
                it as the peer's error).
        """
        try:
            version, flags, count, size, block_hash, parent = _HEAD.unpack_from(data)
            pos = _HEAD.size
            names = []
            for _ in range(2):
                n = data[pos]
                names.append(bytes(data[pos + 1 : pos + 1 + n]).decode())
                pos += 1 + n
            tokens = struct.unpack_from(f"<{count}I", data, pos)
            pos += 4 * count
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise LocalProtocolError(f"malformed block metadata: {exc}") from None
        if version != _VERSION or pos != len(data) or flags & ~0xF:
            raise LocalProtocolError("malformed block metadata (version, flags or length)")
        if count > MAX_META_TOKENS or any(len(n.encode()) > MAX_NAME_BYTES for n in names):
            raise LocalProtocolError("block metadata out of bounds (tokens or names)")
        # Every other bound holds by construction (u32 tokens, u64 hashes): skip the
        # per-token checks of __post_init__, which a restart announcing 1M blocks would pay.
        meta = object.__new__(cls)
        for name, value in (("token_ids", tokens),
                            ("block_hash", block_hash if flags & _HASH else None),
                            ("parent_hash", parent if flags & _PARENT else None),
                            ("lora_name", names[0] if flags & _LORA else None),
                            ("cache_salt", names[1] if flags & _SALT else None),
                            ("block_size", size)):  # fmt: skip
            object.__setattr__(meta, name, value)
        return meta


def check_meta(data: object) -> bytes:
    """Validate a received byte form; returns it.

    Raises:
        LocalProtocolError: not bytes, too long, or malformed.
    """
    if not isinstance(data, bytes) or len(data) > MAX_META_BYTES:
        raise LocalProtocolError(f"block metadata must be at most {MAX_META_BYTES} bytes")
    BlockMeta.decode(data)
    return data
