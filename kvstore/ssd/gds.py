"""The GPUDirect Storage seam: slot I/O through kvikio (cuFile) when it is installed and a CUDA
device is present, so a later step can move blocks between SSD and GPU memory without a host
bounce. Same contract as `SlotFile.read` / `write` for host buffers; kvikio's `pread`/`pwrite`
also accept device buffers, which is the point of the seam.

Not exercised here: this machine has no GPU and no kvikio. `select_slot_file` falls back to the
O_DIRECT host path whenever either is missing.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence

from kvoffload.errors import ConfigError, StorageIOError
from kvoffload.kvstore.ssd.slotio import SlotFile

__all__ = ["KvikioSlotFile", "gds_available", "select_slot_file"]

log = logging.getLogger(__name__)


def gds_available() -> bool:
    """kvikio importable and at least one CUDA device visible."""
    if importlib.util.find_spec("kvikio") is None:
        return False
    try:
        import cupy  # kvikio's own dependency

        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device: the host path serves
        return False


class KvikioSlotFile(SlotFile):
    """`SlotFile` whose reads and writes go through kvikio's cuFile handle."""

    def __init__(self, path: str, size: int) -> None:
        super().__init__(path, size)  # preallocation, O_DIRECT fd for fdatasync
        import kvikio

        self._cufile = kvikio.CuFile(path, "r+")

    def _transfer(self, verb: str, offset: int, buffers: Sequence[memoryview]) -> None:
        op = self._cufile.pread if verb == "read" else self._cufile.pwrite
        for buf in buffers:
            try:
                done = op(buf, len(buf), offset).get()
            except Exception as exc:  # kvikio raises its own runtime errors
                raise StorageIOError(f"cuFile {verb} of {self.path} at {offset}: {exc}") from exc
            if done != len(buf):
                raise StorageIOError(f"cuFile {verb} of {self.path} at {offset}: short transfer")
            offset += len(buf)

    def read(self, offset: int, buffers: Sequence[memoryview]) -> None:
        self._transfer("read", offset, buffers)

    def write(self, offset: int, buffers: Sequence[memoryview]) -> None:
        self._transfer("write", offset, buffers)  # made stable by flush(), as for SlotFile

    def close(self) -> None:
        self._cufile.close()
        super().close()


def select_slot_file(backend: str, path: str, size: int) -> SlotFile:
    """The slot file for `backend`: "posix", "kvikio", or "auto" (kvikio when usable).

    Raises:
        ConfigError: "kvikio" asked for but not usable here.
    """
    if backend == "kvikio" or (backend == "auto" and gds_available()):
        if not gds_available():
            raise ConfigError("ssd.io_backend = 'kvikio' needs the kvikio package and a CUDA GPU")
        log.info("SSD slot I/O through kvikio (GPUDirect Storage)")
        return KvikioSlotFile(path, size)
    return SlotFile(path, size)
