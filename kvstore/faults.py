"""Fault injection for the reliability tests: makes chosen disk operations fail with an errno.

Off unless the environment variable ``KVOFFLOAD_FAULTS`` names a plan file, so a daemon that a
test starts can be reached as well as an engine in the test's own process. The plan is JSON
mapping an operation to an errno name, e.g. ``{"slot.write": "EIO"}``. The file is read again
whenever it changes: a test turns faults on and off while the store runs (replace the file
atomically); a missing file means no faults. A value ``"delay:<seconds>"`` (at most 60) slows
the operation instead of failing it, e.g. ``{"slot.write": "delay:0.02"}``: a slow device.

Operations: ``slot.read``, ``slot.write``, ``slot.flush`` (SlotFile), ``journal.write``,
``journal.sync`` (appends and syncs of the journal; ``journal.write`` also fails creating a new
journal file), ``checkpoint.write`` and ``meta.write`` (the atomically replaced files). On the
io_uring path (`ssd.io_engine`) ``slot.read`` and ``slot.write`` fail each submission as they
fail each ``preadv``/``pwritev`` on the thread path.

``ring.read`` and ``ring.write`` reach into the ring's completions (kvoffload/core/uring.c)
and take a mapping instead of an errno name: ``errno`` (a name; left out: no error), ``entries``
(the indexes, in one submission, of the entries that complete with that error; left out: all),
``delay_s`` (the completions are reaped that much later, the buffers still in flight) and
``short`` (true: the chosen entries report half the bytes the kernel moved, a short transfer;
applied to the results the ring returns, not with ``errno``).

``ring.enter`` takes an errno name: the first ``io_uring_enter`` of each submission fails with
it before the call, the submission's entries queued in the ring and none taken by the kernel
(a ring whose enter failed: it is marked broken and its owner makes a fresh one).
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from kvoffload.errors import ConfigError

__all__ = ["ENV", "OPS", "RING_OPS", "RingFault", "check", "enter_errno", "ring", "wrap"]

ENV = "KVOFFLOAD_FAULTS"
OPS = frozenset(
    {"slot.read", "slot.write", "slot.flush", "journal.write", "journal.sync",
     "checkpoint.write", "meta.write", "ring.enter"}
)  # fmt: skip
RING_OPS = frozenset({"ring.read", "ring.write"})
_MAX_DELAY_S = 60.0  # the ring's own bound


@dataclass(frozen=True)
class RingFault:
    """What `ring.read` / `ring.write` do to a submission's completions."""

    code: int  # errno given to the chosen entries; 0: none
    entries: tuple[int, ...] | None  # None: every entry
    delay_s: float
    short: bool = False  # the chosen entries complete short: half their bytes (a disk full)

    def _chosen(self, count: int) -> list[int]:
        chosen = range(count) if self.entries is None else self.entries
        return [i for i in chosen if 0 <= i < count]

    def fail(self, count: int) -> list[tuple[int, int]]:
        """(index, errno) of the entries of a submission of `count` that fail."""
        return [(i, self.code) for i in self._chosen(count)] if self.code else []

    def shorten(self, results: list[int]) -> list[int]:
        """`results` with each chosen entry that moved bytes cut to half of them."""
        if not self.short:
            return results
        out = list(results)
        for i in self._chosen(len(out)):
            if out[i] > 0:
                out[i] //= 2
        return out


P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
# op -> (errno to raise, 0: none; seconds to wait first), or what a ring op does
_Plan = dict[str, "tuple[int, float] | RingFault"]
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
    return seconds if 0 <= seconds <= _MAX_DELAY_S else None


def _ring_fault(path: str, op: str, spec: object) -> RingFault:
    bad = ConfigError(
        f"{ENV}: fault plan {path}: {op!r} takes a mapping of 'errno' (a name such as 'EIO'), "
        f"'entries' (a list of indexes), 'delay_s' (seconds in [0, {_MAX_DELAY_S:g}]) and "
        "'short' (true: the entries complete with half their bytes; not with 'errno')"
    )
    if not isinstance(spec, dict) or set(spec) - {"errno", "entries", "delay_s", "short"}:
        raise bad
    short = spec.get("short", False)
    if not isinstance(short, bool) or (short and spec.get("errno") is not None):
        raise bad
    name = spec.get("errno")
    code = 0 if name is None else getattr(errno, name, None) if isinstance(name, str) else None
    entries = spec.get("entries")
    delay = spec.get("delay_s", 0.0)
    if not isinstance(code, int) or (code == 0 and name is not None):
        raise bad
    if entries is not None and (
        not isinstance(entries, list)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in entries)
    ):
        raise bad
    if isinstance(delay, bool) or not isinstance(delay, (int, float)):
        raise bad
    if not 0 <= delay <= _MAX_DELAY_S:
        raise bad
    return RingFault(code, None if entries is None else tuple(entries), float(delay), short)


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
        if op in RING_OPS:
            plan[op] = _ring_fault(path, op, name)
            continue
        delay = _delay(name)
        code: object = 0 if delay is not None else None
        if delay is None and isinstance(name, str):
            code = getattr(errno, name, None)
        if op not in OPS or not isinstance(code, int) or (op == "ring.enter" and not code):
            raise ConfigError(
                f"{ENV}: fault plan {path}: {op!r}: {name!r} is not an operation "
                f"({', '.join(sorted(OPS))}) mapped to an errno name such as 'EIO' or to "
                f"'delay:<seconds>' (at most 60), nor a ring operation "
                f"({', '.join(sorted(RING_OPS))})"
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
    """Wait and/or raise the OSError the fault plan names for `op`; nothing when no plan is
    set."""
    path = os.environ.get(ENV)
    if not path:
        return
    found = _plan(path).get(op)
    if not isinstance(found, tuple):
        return
    code, delay = found
    if delay:
        time.sleep(delay)
    if code:
        raise OSError(code, f"{os.strerror(code)} (injected by {ENV})")


def ring(op: str) -> RingFault | None:
    """What the fault plan does to the completions of `op` ("ring.read", "ring.write")."""
    path = os.environ.get(ENV)
    if not path:
        return None
    fault = _plan(path).get(op)
    return fault if isinstance(fault, RingFault) else None


def enter_errno() -> int:
    """The errno `ring.enter` gives each submission's first io_uring_enter; 0: none."""
    path = os.environ.get(ENV)
    if not path:
        return 0
    found = _plan(path).get("ring.enter")
    return found[0] if isinstance(found, tuple) else 0


def wrap(op: str, fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` itself unless a fault plan is set; then `fn` preceded by `check(op)`."""
    if not os.environ.get(ENV):
        return fn

    def faulty(*args: P.args, **kwargs: P.kwargs) -> R:
        check(op)
        return fn(*args, **kwargs)

    return faulty
