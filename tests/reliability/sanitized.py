"""Build every C extension with AddressSanitizer + UBSan and fuzz it (fuzz_native_c.py).

    python tests/reliability/sanitized.py [--runs N] [--seconds S] [TARGET ...]

Each target runs in two stages over one corpus, from real frames:
1. explore: the normal build, where atheris's coverage of the Python around the C calls guides
   libFuzzer and grows the corpus;
2. sanitized: the same harness against the sanitized build, with GCC's libasan (then libstdc++)
   preloaded into Python, PYTHONMALLOC=malloc (Python's own buffers are ASan's too) and UBSan
   halting on its first report: libFuzzer replays
   and mutates the corpus. libasan's no-op coverage hooks shadow libFuzzer's in that process,
   which is why the coverage-guided search is the first stage's job.
A sanitizer report, a harness assertion or an undocumented exception fails the target with
libFuzzer's report; the crashing input is left in the work directory.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("fuzz_native_c.py")
# The runs of one stage, shared by the targets as TARGETS' `share` says.
RUNS = 40_000
# What the sanitizers print; a report must fail the run even if the process exits 0.
_REPORT = re.compile(r"ERROR: AddressSanitizer|runtime error:|ERROR: libFuzzer|SUMMARY: ")


class SanitizerUnavailableError(RuntimeError):
    """No compiler, or no libasan beside it: the sanitized build cannot be made here."""


@dataclass(frozen=True)
class Outcome:
    target: str
    stage: str
    runs: int
    report: str


def libasan() -> str:
    """GCC's ASan runtime (a bare name back from gcc means it is not installed)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SanitizerUnavailableError("gcc not found")
    path = subprocess.run(
        [gcc, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not os.path.isabs(path):
        raise SanitizerUnavailableError("libasan not installed (Debian: libgcc-<version>-dev)")
    return path


def preload() -> str:
    """libasan first, as ASan requires, then libstdc++: ASan finds C++'s `__cxa_throw` only in
    a library loaded with it, and atheris throws one whenever a harness raises."""
    stdcpp = subprocess.run(
        ["gcc", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return f"{libasan()}:{stdcpp}" if os.path.isabs(stdcpp) else libasan()


def build(out: Path) -> Path:
    """`setup.py build_ext` with KVOFFLOAD_SANITIZE=1 into `out`; returns the library folder."""
    lib = out / "lib"
    env = dict(os.environ, KVOFFLOAD_SANITIZE="1")
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext"]
        + ["--build-lib", str(lib), "--build-temp", str(out / "obj")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise SanitizerUnavailableError(f"sanitized build failed:\n{proc.stderr[-4000:]}")
    return lib


@functools.cache
def targets() -> dict[str, float]:
    """The harness table's names and shares (`fuzz_native_c.py --list`, in its own process:
    importing it here would bind the project to whichever build it loads)."""
    proc = _run([HARNESS, "--list"], dict(os.environ, KVOFFLOAD_FUZZ_EXPLORE="1"), 120)
    if proc.returncode != 0:
        raise RuntimeError(f"fuzz_native_c.py --list failed:\n{proc.stderr[-4000:]}")
    return {
        name: float(share)
        for name, share in (line.split() for line in proc.stdout.split("\n") if line.strip())
    }


def run_target(
    name: str,
    share: float,
    lib: Path,
    work: Path,
    runs: int = RUNS,
    seconds: int = 60,
    stages: tuple[str, ...] = ("explore", "sanitized"),
) -> list[Outcome]:
    """The stages of one target; raises AssertionError with libFuzzer's report on a finding."""
    corpus = work / name / "corpus"
    base = dict(os.environ, KVOFFLOAD_SANITIZED_BUILD=str(lib))
    base.pop("LD_PRELOAD", None)
    base.pop("KVOFFLOAD_PURE_PYTHON", None)  # the C is under test, also in the pure-Python run
    n = max(1, int(runs * share))
    outcomes = []
    sanitized = dict(
        base,
        LD_PRELOAD=preload(),
        PYTHONMALLOC="malloc",
        ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=0",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
    )
    explore = dict(base, KVOFFLOAD_FUZZ_EXPLORE="1")
    _run([HARNESS, "--seeds", name, corpus], sanitized, 120)
    for stage in stages:
        env = explore if stage == "explore" else sanitized
        flags = [f"-runs={n}", f"-max_total_time={seconds}", "-max_len=16384", "-rss_limit_mb=0"]
        flags.append(f"-artifact_prefix={work / name}/{stage}-")
        proc = _run([HARNESS, name, *flags, corpus], env, seconds + 120)
        report = proc.stderr[-8000:]
        done = re.search(r"Done (\d+) runs", proc.stderr)
        if proc.returncode != 0 or done is None or _REPORT.search(proc.stderr):
            raise AssertionError(f"{name} ({stage} stage) found a bug:\n{report}")
        outcomes.append(Outcome(name, stage, int(done.group(1)), report))
    return outcomes


def _run(args: list[object], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=HARNESS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help="default: every target of fuzz_native_c.py")
    parser.add_argument("--runs", type=int, default=RUNS, help="inputs per stage, all targets")
    parser.add_argument("--seconds", type=int, default=60, help="bound per target and stage")
    parser.add_argument("--keep", type=Path, help="work folder to keep (corpus, crashes)")
    args = parser.parse_args(argv)
    table = targets()
    chosen = args.targets or sorted(table)
    with tempfile.TemporaryDirectory(prefix="kvoffload-asan-") as tmp:
        work = args.keep or Path(tmp)
        lib = build(work / "build")
        for name in chosen:
            for outcome in run_target(name, table[name], lib, work, args.runs, args.seconds):
                print(f"{outcome.target} ({outcome.stage}): {outcome.runs} inputs, no report")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
