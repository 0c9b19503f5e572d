"""The C extensions under AddressSanitizer + UBSan, fuzzed (sanitized.py, fuzz_native_c.py).

One sanitized build per run (`KVOFFLOAD_SANITIZE=1 setup.py build_ext` into a temp folder),
then every target of fuzz_native_c.py's table for a bounded number of inputs: CI runs 20,000
per stage times each target's share (the shares add up to 1.92; about two minutes on the shared
2-vCPU VM, of which the four `net-*` targets, the client's one-call exchanges against a hostile
daemon over a socketpair, take ~60 s), KVOFFLOAD_RELIABILITY=long 400,000. Without gcc's
libasan the tests skip, except as root or under CI, where that is a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from sanitized import RUNS, SanitizerUnavailableError, build, libasan, run_target, targets

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

LONG = os.environ.get("KVOFFLOAD_RELIABILITY") == "long"
TOTAL = 10 * RUNS if LONG else RUNS // 2
SECONDS = 600 if LONG else 60  # per target and stage: a slow machine ends the run, not CI


@pytest.fixture(scope="module")
def sanitized_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        libasan()
        return build(tmp_path_factory.mktemp("asan"))
    except SanitizerUnavailableError as exc:
        if os.geteuid() == 0 or os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def test_every_extension_is_built_sanitized(sanitized_lib: Path) -> None:
    built = sorted(sanitized_lib.rglob("*.so"))
    assert built, "setup.py built no extension"
    for path in built:
        assert not unsanitized(path), f"{path.name}: {unsanitized(path)}"


def unsanitized(path: Path) -> str:
    """What is missing from `path`'s sanitizing: either runtime, or UBSan's signed-overflow
    checks (Python's -fwrapv drops them unless the build says -fno-wrapv)."""
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    if "libasan" not in needed or "libubsan" not in needed:
        return "not linked with libasan and libubsan"
    symbols = subprocess.run(["nm", "-D", str(path)], capture_output=True, text=True).stdout
    if not re.search(r"__ubsan_handle_(add|sub|mul)_overflow", symbols):
        return "no signed-overflow checks (built with -fwrapv?)"
    return ""


@pytest.mark.parametrize("target", sorted(targets()))
def test_target(target: str, sanitized_lib: Path, tmp_path: Path) -> None:
    share = targets()[target]
    for outcome in run_target(target, share, sanitized_lib, tmp_path, TOTAL, SECONDS):
        print(f"{target} ({outcome.stage}): {outcome.runs} inputs")


def test_a_sanitizer_report_fails_the_run(sanitized_lib: Path, tmp_path: Path) -> None:
    """A write past a heap block under the runner is a failure naming ASan's finding (the
    self-test harness, which is in no default run)."""
    with pytest.raises(AssertionError, match="heap-buffer-overflow"):
        run_target("asan-self-test", 1.0, sanitized_lib, tmp_path, 50, 30, ("sanitized",))
