"""The daemon's C core (`_core`, built by setup.py) and the switch to its Python reference.

`_core` holds what the engine and the daemon run in C: `DramIndex`, the twin of
`kvoffload.kvstore.dram.DramIndex`, and `HotGets`, a connection's DRAM Get hits answered
without the Python session (`kvoffload/core/hot.c`), and `SlotRing`, a minimal io_uring for the
SSD tier's slot I/O (`kvoffload/core/uring.c`; `io_uring_unavailable` says whether the kernel
lets it run), `copy_crc32c`, a copy that sums what it copies (a cold SSD block on its way
into a get's buffer), and `hash_key`, the SSD index's key hash (`hash_key_c`). The Python
forms stay the reference: tests run both (the ring's reference is the SSD tier's thread path).
`KVOFFLOAD_PURE_PYTHON=1` forces Python; `KVOFFLOAD_REQUIRE_EXT=1` makes a missing extension an
ImportError (CI sets it to prove the extension built). `use()` switches at run time (tests);
what it picks applies to objects made afterwards.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from types import ModuleType

import crc32c as _crc32c

from kvoffload.errors import KVOffloadError

__all__ = [
    "IMPLEMENTATION",
    "ExtensionMissingError",
    "available",
    "copy_crc32c",
    "dram_index_type",
    "hash_key_c",
    "hot_gets_type",
    "io_uring_unavailable",
    "slot_ring_type",
    "use",
]


class ExtensionMissingError(KVOffloadError, ImportError):
    """KVOFFLOAD_REQUIRE_EXT is set and the C core did not build or load."""


# What HotGets serves and counts (puts through put_done); a build that says otherwise is stale.
HOT_OPS = 5


def _load() -> ModuleType | None:
    if os.environ.get("KVOFFLOAD_PURE_PYTHON") == "1":
        return None
    try:
        from kvoffload.core import _core

        # A build older than this code (an editable install keeps the .so it built before a
        # `git pull`): a clear ImportError, not an AttributeError at first use.
        if (
            getattr(_core, "HOT_OPS", 0) != HOT_OPS
            or not hasattr(getattr(_core, "SlotRing", None), "submit")
            or not hasattr(getattr(_core, "HotGets", None), "arm")
            or not hasattr(getattr(_core, "HotGets", None), "take_puts")
            or not hasattr(_core, "copy_crc32c")
            or not hasattr(_core, "hash_key")
        ):
            raise ImportError(
                f"{_core.__file__} is older than its Python code: rebuild it with "
                "`pip install -e .` or `python setup.py build_ext --inplace`"
            )
    except ImportError as exc:
        if os.environ.get("KVOFFLOAD_REQUIRE_EXT") == "1":
            raise ExtensionMissingError(f"the C core is required and missing: {exc}") from exc
        if exc.name is None:  # there but stale: say so (a build that is absent is no news)
            warnings.warn(f"kvoffload runs its pure-Python core: {exc}", stacklevel=2)
        return None
    return _core


_EXT = _load()
IMPLEMENTATION = "c" if _EXT is not None else "python"
DISABLED_SYSCTL = "/proc/sys/kernel/io_uring_disabled"
_probed: str | None = None  # why the kernel refused io_uring ("" once it worked)


def available() -> tuple[str, ...]:
    """The implementations this process can use."""
    return ("python", "c") if _EXT is not None else ("python",)


def use(name: str) -> str:
    """Make objects made from now on `name` ("c" or "python"); returns the previous one."""
    global IMPLEMENTATION
    if name not in available():
        raise ValueError(f"implementation {name!r} is not available here ({available()})")
    previous, IMPLEMENTATION = IMPLEMENTATION, name
    return previous


def copy_crc32c(dst: memoryview, src: memoryview) -> int:
    """Copy `src` to the start of `dst` and return its CRC32C (the `crc32c` package's): in C
    one pass over the bytes; the Python reference sums `src`, then copies it.

    Raises:
        ValueError: `dst` is shorter than `src` (or, in C, they overlap).
    """
    if IMPLEMENTATION == "c" and _EXT is not None:
        crc: int = _EXT.copy_crc32c(dst, src)
        return crc
    if len(dst) < len(src):
        raise ValueError(f"destination of {len(dst)} bytes for {len(src)} bytes")
    # Summed from `src` (the engine's pinned copy), not from `dst`: the caller's buffer may
    # change under us (another thread, aliased buffers), and a sum of it could fail a good block.
    crc = int(_crc32c.crc32c(src))
    dst[: len(src)] = src
    return crc


def hash_key_c() -> Callable[[bytes], int] | None:
    """The C twin of `kvstore.ssd.keyhash.hash_key` when the C core is in use; None: use the
    Python reference. Bound once, at import of keyhash (a pure function: `use()` need not
    reach it)."""
    if IMPLEMENTATION != "c" or _EXT is None:
        return None
    fn: Callable[[bytes], int] = _EXT.hash_key
    return fn


def dram_index_type() -> type | None:
    """The C `DramIndex` when the C core is in use; None: use the Python reference."""
    if IMPLEMENTATION != "c" or _EXT is None:
        return None
    index_type: type = _EXT.DramIndex
    return index_type


def hot_gets_type() -> type | None:
    """The C `HotGets` when the C core is in use; None: every request takes the Python path."""
    if IMPLEMENTATION != "c" or _EXT is None:
        return None
    hot_type: type = _EXT.HotGets
    return hot_type


def slot_ring_type() -> type | None:
    """The C `SlotRing` when the C core is in use; None: slot I/O stays on threads."""
    if IMPLEMENTATION != "c" or _EXT is None:
        return None
    ring_type: type = _EXT.SlotRing
    return ring_type


def io_uring_unavailable() -> str | None:
    """Why a `SlotRing` cannot run here, or None when it can.

    Probed once per process at first use: the sysctl `kernel.io_uring_disabled` (2: off for
    everyone; 1: only for a group, which io_uring_setup then answers with EPERM), then a real
    ring that reads one byte from a pipe. Containers often block io_uring_setup (seccomp:
    ENOSYS or EPERM); old kernels lack IORING_OP_READ (EINVAL in the completion).
    """
    global _probed
    ring_type = slot_ring_type()
    if ring_type is None:
        return "the C core is not in use (KVOFFLOAD_PURE_PYTHON=1 or no build)"
    if _probed is None:
        _probed = _probe(ring_type)
    return _probed or None


def _probe(ring_type: type) -> str:
    try:
        with open(DISABLED_SYSCTL, encoding="ascii") as fh:
            if fh.read().strip() == "2":
                return f"{DISABLED_SYSCTL} is 2 (io_uring is disabled on this host)"
    except OSError:
        pass  # no such sysctl before Linux 6.6: the system call answers for itself
    try:
        ring = ring_type(2)
    except OSError as exc:
        return f"io_uring_setup failed: {exc.strerror or exc} (blocked or not built in)"
    r, w = os.pipe()
    try:
        os.write(w, b"k")
        got = bytearray(1)
        result = ring.submit([(r, 0, got, False)])[0]
    except OSError as exc:
        return f"io_uring_enter failed: {exc.strerror or exc}"
    finally:
        ring.close()
        os.close(r)
        os.close(w)
    if result != 1 or got != b"k":
        return f"a probe read through io_uring answered {result} (IORING_OP_READ unsupported?)"
    return ""
