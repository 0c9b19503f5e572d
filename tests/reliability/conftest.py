"""Fixtures of the reliability suite: a small real file system to fill, a fault plan for
KVOFFLOAD_FAULTS, and stores (an in-process engine or a daemon subprocess) to put faults under."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from stores import DaemonStore, EngineStore, FaultPlan

from kvoffload.kvstore import faults

FS_BYTES = 64 << 20


def _cannot(reason: str) -> None:
    """Root (as in CI) must be able to mount: a failure there is a failure, not a skip."""
    if os.geteuid() == 0 or os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def _which(tool: str) -> str | None:
    # The sbin folders may be missing from PATH outside a login shell.
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [_which(tool) or tool, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB file system of its own, unmounted at teardown: ext4 on a loop-mounted image by
    default (the slot file's O_DIRECT needs a real file system), or "tmpfs" through indirect
    parametrisation (where O_DIRECT may be refused and the slot file falls back to buffered
    I/O)."""
    kind = getattr(request, "param", "ext4")
    if os.geteuid() != 0:
        _cannot(f"mounting a 64 MiB {kind} needs root (CI runs the suite as root)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    image = tmp_path / "fs.img"
    if kind == "tmpfs":
        mounted = _run("mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mnt))
    else:
        for tool, package in (("mkfs.ext4", "e2fsprogs"), ("mount", "mount")):
            if _which(tool) is None:
                _cannot(f"{tool} is not installed: `apt-get install {package}` (.ci/deps does)")
        image.touch()
        os.truncate(image, FS_BYTES)
        # -m 0: no blocks reserved for root: what statvfs reports free is what the store gets.
        made = _run("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
        if made.returncode:
            _cannot(f"mkfs.ext4 failed: {made.stderr.strip()}")
        mounted = _run("mount", "-o", "loop", str(image), str(mnt))
    if mounted.returncode:
        _cannot(f"cannot mount a {kind} (no loop device?): {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        for _ in range(20):  # a daemon that was just stopped may still hold a file briefly
            if _run("umount", str(mnt)).returncode == 0:
                break
            time.sleep(0.5)
        else:
            _run("umount", "-l", str(mnt))
        image.unlink(missing_ok=True)


@pytest.fixture
def fault_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FaultPlan:
    """A fault plan, empty at first, seen by engines made in this process and by daemons
    started with `plan.env`."""
    plan = FaultPlan(tmp_path / "faults.json")
    plan.set()
    monkeypatch.setenv(faults.ENV, str(plan.path))
    return plan


# "engine" and "daemon" run the default slot I/O (io_uring where the kernel allows it);
# "engine-threads" the thread path, in process only, to keep the suite's time in bounds.
@pytest.fixture(params=["engine", "daemon", "engine-threads"])
def open_store(
    request: pytest.FixtureRequest, tmp_path: Path, start_daemon: Callable[..., Any]
) -> Iterator[Callable[..., EngineStore | DaemonStore]]:
    """Open a store (engine or daemon) on a data directory; closed when the test ends."""
    opened: list[EngineStore | DaemonStore] = []

    def open_(data: Path, *, dram: int = 4 << 20, ssd: int = 32 << 20,
              env: dict[str, str] | None = None) -> EngineStore | DaemonStore:  # fmt: skip
        store: EngineStore | DaemonStore
        if request.param == "engine":
            store = EngineStore(data, dram=dram, ssd=ssd)
        elif request.param == "engine-threads":
            store = EngineStore(data, dram=dram, ssd=ssd, io_engine="threads")
        else:
            store = DaemonStore(start_daemon, data, dram=dram, ssd=ssd, env=env or {})
        opened.append(store)
        return store

    yield open_
    for store in opened:
        with contextlib.suppress(Exception):
            store.stop()
