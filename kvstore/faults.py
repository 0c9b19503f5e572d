"""Fault injection for the reliability tests: makes chosen disk operations fail with an errno.

Off unless the environment variable ``KVOFFLOAD_FAULTS`` names a plan file, so a daemon that a
test starts can be reached as well as an engine in the test's own process. The plan is JSON
mapping an operation to an errno name, e.g. ``{"slot.write": "EIO"}``. The file is read again
whenever it changes: a test turns faults on and off while the store runs (replace the file
atomically); a missing file means no faults. A value ``"delay:<seconds>"`` (at most 60) slows
the operation instead of failing it, e.g. ``{"slot.write": "delay:0.02"}``: a slow device.

Operations: ``slot.read``, ``slot.write``, ``slot.flush`` (SlotFile), ``journal.write``,
``journal.sync`` (appends and syncs of the journal; ``journal.write`` also fails creating a new
journal file), ``checkpoint.write`` and ``meta.write`` (the atomically replaced files).
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from kvoffload.errors import ConfigError

__all__ = ["ENV", "OPS", "check", "wrap"]

ENV = "KVOFFLOAD_FAULTS"
OPS = frozenset(
    {"slot.read", "slot.write", "slot.flush", "journal.write", "journal.sync",
     "checkpoint.write", "meta.write"}
)  # fmt: skip

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
# op -> errno to raise (0: none) and seconds to wait first.
_Plan = dict[str, tuple[int, float]]
_cached: tuple[tuple[str, int, int, int], _Plan] | None = None
_DELAY = "delay:"


def _delay(name: object) -> float | None:
    """The seconds of a ``"delay:<seconds>"`` value, or None if it is not one."""
    if not isinstance(name, str) or not name.startswith(_DELAY):
        return None
    try:
        seconds = float(name[len(_DELAY) :])
    except ValueError:
        return None
    return seconds if 0 <= seconds <= 60 else None


def _load(path: str) -> _Plan:
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{ENV}: cannot read fault plan {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{ENV}: fault plan {path} must be a JSON object")
    plan: _Plan = {}
    for op, name in raw.items():
        delay = _delay(name)
        code: object = 0 if delay is not None else None
        if delay is None and isinstance(name, str):
            code = getattr(errno, name, None)
        if op not in OPS or not isinstance(code, int):
            raise ConfigError(
                f"{ENV}: fault plan {path}: {op!r}: {name!r} is not an operation "
                f"({', '.join(sorted(OPS))}) mapped to an errno name such as 'EIO' or to "
                "'delay:<seconds>' (at most 60)"
            )
        plan[op] = (code, delay or 0.0)
    return plan


def _plan(path: str) -> _Plan:
    global _cached
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {}
    stamp = (path, st.st_ino, st.st_mtime_ns, st.st_size)
    with _lock:
        if _cached is not None and _cached[0] == stamp:
            return _cached[1]
    plan = _load(path)
    with _lock:
        _cached = (stamp, plan)
    return plan


def check(op: str) -> None:
    """Wait the delay, or raise the OSError, the fault plan names for `op`; nothing when no
    plan is set."""
    path = os.environ.get(ENV)
    if not path:
        return
    code, delay = _plan(path).get(op, (0, 0.0))
    if delay:
        time.sleep(delay)
    if code:
        raise OSError(code, f"{os.strerror(code)} (injected by {ENV})")


def wrap(op: str, fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` itself unless a fault plan is set; then `fn` preceded by `check(op)`."""
    if not os.environ.get(ENV):
        return fn

    def faulty(*args: P.args, **kwargs: P.kwargs) -> R:
        check(op)
        return fn(*args, **kwargs)

    return faulty
