"""Helpers of the reliability suite: fill a file system, a fault plan for KVOFFLOAD_FAULTS, and
one store interface over an in-process engine or a daemon subprocess."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.client_sdk import Client
from kvoffload.errors import StorageIOError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig, faults


def free_bytes(fs: Path) -> int:
    st = os.statvfs(fs)
    return st.f_bavail * st.f_frsize


def fill(fs: Path, leave: int) -> Path:
    """Take all but about `leave` bytes of `fs` with a file (delete it to free them); with
    `leave` 0, every last block."""
    path = fs / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        want = free_bytes(fs) - leave
        while want > 0:  # the extent tree needs blocks too: back off until it fits
            try:
                os.posix_fallocate(fd, 0, want)
                break
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                want -= 64 << 10
        if not leave:
            os.lseek(fd, 0, os.SEEK_END)
            for _ in range(100_000):  # bounded: 400 MB at most, far more than the fs holds
                try:
                    os.write(fd, bytes(4096))
                    os.fsync(fd)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


class FaultPlan:
    """The file KVOFFLOAD_FAULTS names; `set` replaces it atomically (stores re-read it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def env(self) -> dict[str, str]:
        return {faults.ENV: str(self.path)}

    def set(self, **ops: str) -> None:
        """`slot_write="EIO"` makes slot writes fail with EIO; no arguments: no faults."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({op.replace("_", "."): code for op, code in ops.items()}))
        os.replace(tmp, self.path)


# ---------------------------------------------------------------------------- stores


class EngineStore:
    """The store as an engine in this process."""

    kind = "engine"

    def __init__(self, data: Path, *, dram: int, ssd: int, io_engine: str = "auto") -> None:
        self.config = EngineConfig(
            DramConfig(capacity_bytes=dram, max_value_bytes=256 << 10, prefault=False),
            SsdConfig(capacity_bytes=ssd, admission_min_uses=1, io_engine=io_engine),
            data_dir=str(data),
        )
        self.engine = Engine(self.config)
        self.io_engine = io_engine

    def put(self, key: bytes, value: bytes, *, durable: bool = False) -> None:
        self.engine.put(key, value, durable=durable)

    def get(self, key: bytes) -> bytes | None:
        buf = bytearray(256 << 10)
        n = self.engine.get_into(key, buf)
        return None if n is None else bytes(buf[:n])

    def stats(self) -> dict[str, Any]:
        return self.engine.stats().as_dict()

    def stop(self) -> str:
        """Close; returns what went wrong (empty if nothing)."""
        try:
            self.engine.close()
        except StorageIOError as exc:
            return str(exc)
        return ""

    def restart(self) -> str:
        said = self.stop()
        self.engine = Engine(self.config)
        return said


class DaemonStore:
    """The store as a `kvoffload serve` subprocess, reached through the native front."""

    kind = "daemon"

    def __init__(self, start: Callable[..., Any], data: Path, *, dram: int, ssd: int,
                 env: dict[str, str]) -> None:  # fmt: skip
        self._start = start
        self._flags = ("--data-dir", str(data), "--dram", str(dram), "--ssd", str(ssd))
        self._env = {"KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1",
                     "KVOFFLOAD_DRAM__MAX_VALUE_BYTES": str(256 << 10), **env}  # fmt: skip
        self._up()

    def _up(self) -> None:
        self.daemon = self._start(*self._flags, env=self._env)
        self._stopped = False
        self.client = Client.connect(self.daemon.url(timeout="30"))

    def put(self, key: bytes, value: bytes, *, durable: bool = False) -> None:
        self.client.put(key, value, durable=durable)

    def get(self, key: bytes) -> bytes | None:
        return self.client.get(key)

    def stats(self) -> dict[str, Any]:
        assert self.daemon.proc.poll() is None, "the daemon died"
        return self.client.stats().store

    def stop(self) -> str:
        """SIGTERM and wait; returns what the daemon said on stderr if it exited nonzero."""
        self.client.close()
        if self._stopped:
            return ""
        self._stopped = True
        code = self.daemon.stop()
        said = self.daemon.stderr()
        # Faults are reported as errors, never as a crash of some thread.
        assert "Traceback" not in said, said
        return "" if code == 0 else f"exit {code}: {said}"

    def restart(self) -> str:
        said = self.stop()
        self._up()
        return said

    def crash_and_restart(self) -> None:
        """SIGKILL (by pid) and start again: only what reached the disk counts."""
        self.client.close()
        self.daemon.proc.kill()
        self.daemon.stop()
        self._up()


def io_errors(stats: dict[str, Any]) -> int:
    return int(stats["tiers"][1]["io_errors"])


def io_engine(stats: dict[str, Any]) -> str:
    """What moves the SSD tier's blocks ("io_uring", "threads", ...)."""
    return str(stats["tiers"][1]["io_engine"])
