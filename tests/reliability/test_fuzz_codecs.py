"""Runs each coverage-guided harness of fuzz_codecs.py (atheris) for a bounded number of inputs.

CI runs the short form (50,000 inputs across the harnesses); KVOFFLOAD_RELIABILITY=long runs
200,000. Each harness runs in its own process (atheris exits when done), from a seed corpus of
real frames; a crash leaves its input under the test's tmp directory and fails the test with
libFuzzer's report.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HARNESS = Path(__file__).with_name("fuzz_codecs.py")
LONG = os.environ.get("KVOFFLOAD_RELIABILITY") == "long"
# Share of the inputs per harness (the NVMe ones are slower per input; the data parsers small).
SHARES = {
    "native-server": 0.3,
    "native-client": 0.2,
    "nvme-target": 0.2,
    "nvme-host": 0.2,
    "nvme-data": 0.1,
}
TOTAL = 200_000 if LONG else 50_000
# Wall-clock bound per harness, so a slow machine ends the run instead of the CI job.
MAX_SECONDS = 600 if LONG else 60
# The memory bound: an address-space limit, under which a runaway allocation raises
# MemoryError inside the harness (a bug it reports). Not libFuzzer's -rss_limit_mb: it reads
# the peak RSS, which Linux carries across exec, so a harness started from a test process that
# had loaded the model would be "out of memory" before its first input.
MEMORY_LIMIT = 2 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.parametrize("target", sorted(SHARES))
def test_harness(target: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    subprocess.run(
        [sys.executable, str(HARNESS), "--seeds", target, str(corpus)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    runs = int(TOTAL * SHARES[target])
    out = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            target,
            f"-runs={runs}",
            f"-max_total_time={MAX_SECONDS}",
            "-rss_limit_mb=0",
            "-max_len=16384",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=MAX_SECONDS + 120,
        preexec_fn=_limit_memory,
    )
    report = out.stderr[-6000:]
    assert out.returncode == 0, f"{target} found a bug:\n{report}"
    done = re.search(r"Done (\d+) runs", out.stderr)
    assert done is not None, report
    print(f"{target}: {done.group(1)} inputs (asked {runs})")
