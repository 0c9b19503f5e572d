"""The daemon's C core (`_core`, built by setup.py) and the switch to its Python reference.

`_core` holds what the engine and the daemon run in C: `DramIndex`, the twin of
`kvoffload.kvstore.dram.DramIndex`, and `HotGets`, a connection's DRAM Get hits answered
without the Python session (`kvoffload/core/hot.c`). The Python forms stay the reference: tests
run both.
`KVOFFLOAD_PURE_PYTHON=1` forces Python; `KVOFFLOAD_REQUIRE_EXT=1` makes a missing extension an
ImportError (CI sets it to prove the extension built). `use()` switches at run time (tests);
what it picks applies to objects made afterwards.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

from kvoffload.errors import KVOffloadError

__all__ = [
    "IMPLEMENTATION",
    "ExtensionMissingError",
    "available",
    "dram_index_type",
    "hot_gets_type",
    "use",
]


class ExtensionMissingError(KVOffloadError, ImportError):
    """KVOFFLOAD_REQUIRE_EXT is set and the C core did not build or load."""


HOT_OPS = 4  # what HotGets serves and counts; a build that says otherwise is stale


def _load() -> ModuleType | None:
    if os.environ.get("KVOFFLOAD_PURE_PYTHON") == "1":
        return None
    try:
        from kvoffload.core import _core

        # A build older than this code (an editable install keeps the .so it built before a
        # `git pull`): a clear ImportError, not an AttributeError at first use.
        if getattr(_core, "HOT_OPS", 0) != HOT_OPS:
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
