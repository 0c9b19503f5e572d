"""`kvoffload top` run in a pseudo-terminal, and its screen read back as text."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable

# CSI sequences (cursor moves, colours, the alternate screen) and the rest of ESC's forms.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>78]")

_RULES = re.compile("[│┃]")  # a table's column rules (heavy ones in its header)


class TopScreen:
    """`kvoffload top ARGS` on a 200x50 pseudo-terminal; its output is read continuously."""

    def __init__(self, *args: str) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.slave_modes = termios.tcgetattr(slave)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
        env.update(TERM="xterm-256color", COLUMNS="200", LINES="50")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvoffload.cli", "top", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
            # The pty becomes its controlling terminal, as over ssh: Ctrl-C typed there
            # interrupts it.
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        self.slave = slave
        self._raw = bytearray()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return  # the child closed the terminal
            if not chunk:
                return
            with self._lock:
                self._raw += chunk

    @property
    def text(self) -> str:
        with self._lock:
            raw = bytes(self._raw)
        return _ESCAPES.sub("", raw.decode("utf-8", "replace"))

    def frame(self) -> str:
        """The last complete screen drawn (title to caption)."""
        text = self.text
        end = text.rfind("q or Ctrl-C to quit")
        start = text.rfind("kvoffload top", 0, end)
        return text[start:end] if start >= 0 and end >= 0 else ""

    def row(self, name: str) -> list[str]:
        """The cells of `name`'s row in the last frame ([] when it has none)."""
        for line in self.frame().splitlines():
            cells = [c.strip() for c in _RULES.split(line.strip().strip("│┃"))]
            if cells and cells[0] == name:
                return cells
        return []

    def wait_for(self, what: str, ok: Callable[[], bool], timeout_s: float = 30) -> None:
        """Wait until `ok()` (a bounded wait, not a timing check)."""
        deadline = time.monotonic() + timeout_s
        while not ok():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{what}: never seen; screen:\n{self.frame() or self.text}")
            time.sleep(0.1)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def wait(self, timeout_s: float = 30) -> int:
        return self.proc.wait(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)
