"""The batch read pool: threads that run the slot reads of batched gets (`kvstore.promote`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

__all__ = ["ReadPool"]

log = logging.getLogger(__name__)

_Call = tuple[Callable[..., object], tuple[Any, ...]]


class ReadPool:
    """`threads` threads running submitted calls first in, first out; started on the first.

    Lighter per call than `ThreadPoolExecutor` (no Future and work item per call, no thread
    bookkeeping per submit): a batch's reads report to the batch themselves. The threads are
    daemons: a read hung in the kernel does not hold up the interpreter's exit.
    """

    def __init__(self, threads: int, name: str) -> None:
        self._size = threads
        self._name = name
        self._calls: SimpleQueue[_Call | None] = SimpleQueue()
        self._lock = threading.Lock()  # orders submits against shutdown's stop marks
        self._threads: list[threading.Thread] = []
        self._shut = False

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue `fn(*args)`; what it raises is logged, it should report on its own.

        Raises:
            RuntimeError: the pool is shut down (as `ThreadPoolExecutor.submit`).
        """
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new reads after shutdown")
            if not self._threads:
                for i in range(self._size):
                    thread = threading.Thread(target=self._work, name=f"{self._name}_{i}",
                                              daemon=True)  # fmt: skip
                    thread.start()
                    self._threads.append(thread)
            self._calls.put((fn, args))

    def shutdown(self, wait: bool = True) -> None:
        """Stop once every call submitted so far has run; with `wait`, return only then."""
        with self._lock:
            if not self._shut:
                self._shut = True
                for _ in self._threads:
                    self._calls.put(None)
            threads = list(self._threads)
        if wait:
            for thread in threads:
                thread.join()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args = call
            try:
                fn(*args)
            except BaseException:  # a read reports its own failures; this is a last resort
                log.exception("kvoffload: a batch read failed")
