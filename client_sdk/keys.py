"""Block identity: namespaces and chained blake3 block keys (DESIGN §3).

Keys are pure functions of their inputs, identical in every process and on every machine: no
Python `hash()`, no process-random seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import NewType

import blake3
import numpy as np

from kvoffload.compression import DTYPE_BYTES, BlockSpec, codec_info
from kvoffload.errors import InvalidArgumentError, UnsupportedCodecConfigError

__all__ = [
    "DTYPE_BYTES",
    "KEY_BYTES",
    "ROOT_PARENT",
    "BlockHash",
    "BlockKey",
    "Namespace",
    "block_hashes",
    "block_keys",
    "engine_hashes",
    "engine_keys",
    "to_key",
]

KEY_BYTES = 16
# A 16-byte key is also the largest key of the NVMe Key Value command set.
BlockKey = NewType("BlockKey", bytes)
# The full 32-byte chain digest; its first 16 bytes are the block's key.
BlockHash = NewType("BlockHash", bytes)
ROOT_PARENT = BlockKey(bytes(KEY_BYTES))


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two blocks of the same tokens incompatible.

    Two blocks may share a key only if they were produced under equal namespaces; the 16-byte
    `fingerprint` is mixed into every key and stored in every block header.
    """

    model: str
    dtype: str = "bfloat16"
    block_tokens: int = 16
    num_layers: int = 1
    num_kv_heads: int = 1
    head_size: int = 1
    revision: str = ""
    # Byte order of one block's KV: "LKHTD" = [layer][k/v][kv head][token][head dim].
    layout: str = "LKHTD"
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""
    # How keys are chained: "tokens" (block_keys over token ids) or an engine's own hash
    # (e.g. "vllm:sha256_cbor"); blocks keyed differently never collide.
    hash_algo: str = "tokens"
    # Per-deployment salt (vLLM's cache_salt); empty for none.
    salt: str = ""
    format_version: int = 1
    # Codec for this namespace's blocks (see kvoffload.compression), used by clients that do
    # not name one; "" = none. A lossy codec changes the KV a reader gets, so it is part of the
    # blocks' identity (it enters the fingerprint); a lossless one is not (the same block
    # stored raw or compressed has the same key).
    codec: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgumentError("Namespace.model must name the model")
        for name in ("block_tokens", "num_layers", "num_kv_heads", "head_size", "tp_size"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"Namespace.{name} must be positive")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgumentError(
                f"Namespace.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgumentError(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_BYTES)}"
            )
        if self.codec:
            try:
                codec_info(self.codec)
            except UnsupportedCodecConfigError as exc:
                raise InvalidArgumentError(f"Namespace.codec: {exc}") from None

    @property
    def lossy_codec(self) -> str:
        """The namespace's codec if it is lossy, else ""."""
        return self.codec if self.codec and not codec_info(self.codec).lossless else ""

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes naming this namespace; stable across processes, versions and machines."""
        hasher = blake3.blake3(b"kvoffload.namespace\x00")
        for f in fields(self):
            if f.name == "codec" and not self.lossy_codec:
                # Lossless codecs do not change block identity; leaving the record out also
                # keeps every fingerprint from before the field existed.
                continue
            # name=value records, each length-prefixed so no two namespaces serialise alike.
            record = f"{f.name}={getattr(self, f.name)!r}".encode()
            hasher.update(len(record).to_bytes(4, "little") + record)
        return bytes(hasher.digest()[:KEY_BYTES])

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token on this rank: K and V of every layer and kv head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Raw (uncompressed) bytes of one full block."""
        return self.bytes_per_token * self.block_tokens

    @cached_property
    def block_spec(self) -> BlockSpec:
        """What codecs may know of one block: the dtype and, for the LKHTD layout, its shape."""
        if self.layout != "LKHTD":
            return BlockSpec(self.dtype)
        return BlockSpec.kv(
            self.dtype, self.num_layers, self.num_kv_heads, self.block_tokens, self.head_size
        )


def to_key(key: bytes, what: str = "key") -> BlockKey:
    """Accept a 16-byte key or a 32-byte chain hash; return the 16-byte key.

    Raises:
        InvalidArgumentError: neither 16 nor 32 bytes.
    """
    if isinstance(key, (bytes, bytearray)) and len(key) in (KEY_BYTES, 2 * KEY_BYTES):
        return BlockKey(bytes(key[:KEY_BYTES]))
    got = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else type(key).__name__
    raise InvalidArgumentError(f"{what} must be a 16-byte block key or a 32-byte hash, got {got}")


def _extra_bytes(extra_keys: Sequence[bytes | str | int]) -> bytes:
    out = bytearray()
    for extra in extra_keys:
        if isinstance(extra, bool) or not isinstance(extra, (bytes, str, int)):
            raise InvalidArgumentError(
                f"extra keys must be bytes, str or int, got {type(extra).__name__}"
            )
        if isinstance(extra, str):
            tag, raw = b"s", extra.encode()
        elif isinstance(extra, int):
            tag, raw = b"i", str(extra).encode()
        else:
            tag, raw = b"b", bytes(extra)
        out += tag + len(raw).to_bytes(4, "little") + raw
    return bytes(out)


def block_hashes(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    parent: bytes | None = None,
    extra_keys: Sequence[bytes | str | int] = (),
) -> list[BlockHash]:
    """32-byte chain digests of each full block of `token_ids`; see `block_keys`."""
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise InvalidArgumentError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
    if tokens.size and (tokens.dtype.kind not in "iu" or tokens.min() < 0 or tokens.max() >= 2**32):
        raise InvalidArgumentError("token ids must be integers in [0, 2**32)")
    size = namespace.block_tokens
    n_blocks = tokens.size // size
    # Token ids hash as little-endian uint32, the same bytes on every platform.
    data = tokens[: n_blocks * size].astype("<u4").tobytes()
    stride = 4 * size
    fp = namespace.fingerprint
    extra = _extra_bytes(extra_keys)
    prev = ROOT_PARENT if parent is None else to_key(parent, "parent")
    out: list[BlockHash] = []
    for i in range(n_blocks):
        digest = blake3.blake3(fp + prev + data[i * stride : (i + 1) * stride] + extra).digest()
        out.append(BlockHash(bytes(digest)))
        prev = BlockKey(out[-1][:KEY_BYTES])
    return out


def block_keys(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    parent: bytes | None = None,
    extra_keys: Sequence[bytes | str | int] = (),
) -> list[BlockKey]:
    """Chained 16-byte keys of each full block of `token_ids` (a partial tail block gets none).

    ``key_i = blake3(fingerprint ‖ key_{i-1} ‖ uint32le(tokens of block i) ‖ extra)[:16]`` with
    ``key_{-1} = parent`` (16 zero bytes for a sequence that starts at token 0).

    Args:
        namespace: the model/layout the blocks belong to.
        token_ids: the token ids of the sequence (list, numpy array or CPU tensor).
        parent: key of the block just before `token_ids[0]`, to continue a chain.
        extra_keys: values mixed into every block's key (a LoRA name, a multimodal hash).

    Raises:
        InvalidArgumentError: ids out of range, a malformed parent or extra key.
    """
    return [BlockKey(h[:KEY_BYTES]) for h in block_hashes(namespace, token_ids, parent, extra_keys)]


def engine_hashes(namespace: Namespace, hashes: Sequence[bytes]) -> list[BlockHash]:
    """32-byte digests for blocks that a serving engine already names with its own hashes.

    vLLM, SGLang and LMCache chain their own block hashes over token ids (and LoRA, multimodal
    inputs, cache salts); re-hashing the tokens would only duplicate that work and could
    disagree with what the engine considers the same block. Instead each engine hash is mixed
    with the namespace fingerprint: ``blake3("kvoffload.engine\0" ‖ fingerprint ‖ len ‖
    hash)``, so equal engine hashes under different models, dtypes, layouts, ranks, hash
    algorithms or salts never share a key.

    Args:
        namespace: a namespace whose `hash_algo` names the engine's hash (anything but the
            SDK's own "tokens").
        hashes: the engine's per-block hashes or names, any non-empty byte strings.

    Raises:
        InvalidArgumentError: the namespace uses token keys, or a hash is empty or not bytes.
    """
    if namespace.hash_algo == "tokens":
        raise InvalidArgumentError(
            "engine hashes need a namespace whose hash_algo names the engine's hash "
            "(e.g. 'vllm:sha256'), not 'tokens'"
        )
    prefix = b"kvoffload.engine\x00" + namespace.fingerprint
    out: list[BlockHash] = []
    for raw in hashes:
        if not isinstance(raw, (bytes, bytearray)) or not raw:
            raise InvalidArgumentError(
                f"engine hashes must be non-empty bytes, got {type(raw).__name__}"
            )
        digest = blake3.blake3(prefix + len(raw).to_bytes(4, "little") + bytes(raw)).digest()
        out.append(BlockHash(bytes(digest)))
    return out


def engine_keys(namespace: Namespace, hashes: Sequence[bytes]) -> list[BlockKey]:
    """The 16-byte keys of `engine_hashes` (their first 16 bytes)."""
    return [BlockKey(h[:KEY_BYTES]) for h in engine_hashes(namespace, hashes)]
