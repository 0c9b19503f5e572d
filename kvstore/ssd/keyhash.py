"""The 64-bit hash of a 16-byte key that the SSD index, its ghost filter and the admission
sketch share (splitmix64 of the key's halves), for one key and for a column of keys."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvoffload.core import hash_key_c

__all__ = ["hash_key", "hash_key_py", "hash_keys"]

_MASK64 = (1 << 64) - 1


def hash_key_py(key: bytes) -> int:
    """splitmix64 of the key's two halves (keys need not be uniform: tests use small ints).
    The reference; `hash_key` is its C twin when the C core is in use (a cold block's read
    hashes its key four times, each a dozen big-int operations here)."""
    h = int.from_bytes(key[:8], "little") ^ (
        int.from_bytes(key[8:16], "little") * 0x9E3779B97F4A7C15
    )
    h &= _MASK64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
    return h ^ (h >> 31)


def hash_keys(keys: npt.NDArray[np.bytes_]) -> npt.NDArray[np.uint64]:
    """`hash_key` for a column of S16 keys (wrapping uint64 arithmetic)."""
    halves = np.frombuffer(keys.tobytes(), dtype="<u8").reshape(-1, 2)
    with np.errstate(over="ignore"):
        h = halves[:, 0] ^ (halves[:, 1] * np.uint64(0x9E3779B97F4A7C15))
        h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: npt.NDArray[np.uint64] = h ^ (h >> np.uint64(31))
    return out


hash_key: Callable[[bytes], int] = hash_key_c() or hash_key_py
