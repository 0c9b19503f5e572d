"""Atheris harnesses for the C extensions, run against their AddressSanitizer + UBSan build.

`sanitized.py` builds that (`KVOFFLOAD_SANITIZE=1 setup.py build_ext`) and runs one target per
process, with libasan preloaded into this Python:

    KVOFFLOAD_SANITIZED_BUILD=DIR python tests/reliability/fuzz_native_c.py TARGET [libFuzzer flags]
    python tests/reliability/fuzz_native_c.py --seeds TARGET CORPUS | --list

Every extension module under DIR replaces the installed one before the project is imported,
and a target refuses to run when the module it drives is not from DIR (a harness that silently
fuzzed the unsanitized build, or the Python fallback, would prove nothing).

With KVOFFLOAD_FUZZ_EXPLORE=1 the installed (unsanitized) build is fuzzed instead: there
atheris's coverage works and grows the corpus that the sanitized stage then replays.

A target fails on a sanitizer report (the process aborts with it on stderr), on an error the C
function does not document, and where the Python reference exists, on any answer that differs
from it. GCC has no libFuzzer coverage for C, so the mutations are guided by the Python code
around the C calls and start from real frames; the sanitizers check every byte the C touches.

Adding a target (the daemon's C hot path, the C index): write `fuzz(data: bytes) -> None` and a
seed list, or for a C object that consumes a byte stream use `stream_target`, and add the
`Target` to TARGETS; `sanitized.py` and its test pick every entry up (`share` of the runs).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import atheris
import numpy as np


def load_sanitized(build: Path) -> dict[str, ModuleType]:
    """Import every extension module under `build` (a `build_ext --build-lib` folder) under its
    dotted name, so that the project's own imports find these and not the installed ones."""
    loaded: dict[str, ModuleType] = {}
    for path in sorted(build.rglob("*.so")):
        # The most specific suffix names the module (".cpython-311-x86_64-linux-gnu.so" first).
        suffix = next(s for s in importlib.machinery.EXTENSION_SUFFIXES if path.name.endswith(s))
        rel = path.relative_to(build)
        name = ".".join([*rel.parts[:-1], rel.name[: -len(suffix)]])
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        loaded[name] = module
    if not loaded:
        raise ImportError(f"no extension modules under {build}")
    return loaded


def _load() -> dict[str, ModuleType]:
    build = os.environ.get("KVOFFLOAD_SANITIZED_BUILD")
    if EXPLORE or not build:
        return {}
    return load_sanitized(Path(build))


# The explore stage (sanitized.py) fuzzes the normal build, where atheris's coverage works.
EXPLORE = os.environ.get("KVOFFLOAD_FUZZ_EXPLORE") == "1"
# Before any project import: the project must bind the sanitized modules.
SANITIZED = _load()

# fuzz_codecs imports the project under atheris's instrumentation; these names are its.
from fuzz_codecs import _CLIENT_REQUESTS, LIMITS, _chunks, native_seeds  # noqa: E402

from kvoffload.errors import KVOffloadError, RemoteProtocolError  # noqa: E402
from kvoffload.wire import fast  # noqa: E402
from kvoffload.wire.native import connection as nw  # noqa: E402


@dataclass(frozen=True)
class Target:
    """One harness: `fuzz` takes one input; `seeds` are real inputs to start from; `module`
    is the extension it drives (checked to be the sanitized one); `share` of the runs."""

    fuzz: Callable[[bytes], None]
    seeds: Callable[[], list[bytes]]
    module: str
    share: float


def stream_target(
    make: Callable[[], Any],
    feed: Callable[[Any, bytes], object],
    *,
    module: str,
    seeds: Callable[[], list[bytes]],
    errors: tuple[type[BaseException], ...] = (KVOffloadError,),
    close: Callable[[Any], object] | None = None,
    share: float = 0.2,
) -> Target:
    """A target for a C object that consumes a byte stream: each input is one byte choosing
    the chunk size, then the stream; `feed(obj, chunk)` per chunk, then `feed(obj, b"")` for
    the peer's close. An exception in `errors` ends the stream (the documented refusal);
    anything else is a bug."""

    def fuzz(data: bytes) -> None:
        _, chunks = _chunks(data)
        obj = make()
        try:
            for chunk in [*chunks, b""]:
                feed(obj, chunk)
        except errors:
            pass
        finally:
            if close is not None:
                close(obj)

    return Target(fuzz, seeds, module, share)


# ------------------------------------------------------------------ _speedups: one call each
SPEEDUPS = "kvoffload.wire._speedups"
_ARG_ERRORS = (ValueError, OverflowError, TypeError, BufferError)
_HOSTILE = (0, 1, 23, 24, 25, 64, 4096, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1)


def _hostile_int(fdp: atheris.FuzzedDataProvider) -> int:
    """Mostly the lengths a codec must survive (0, the frame head's 24, 2**32, 2**64 - 1...),
    sometimes any 65-bit signed value."""
    if fdp.ConsumeBool():
        return int(fdp.PickValueInList(list(_HOSTILE))) - int(fdp.ConsumeIntInRange(0, 1))
    return int(fdp.ConsumeIntInRange(-(2**64), 2**64))


def fuzz_parse_frame(data: bytes) -> None:
    """`parse_frame` on any buffer with hostile start, end and limits: None, a documented
    argument error, or an event whose frame lies inside [start, end)."""
    fdp = atheris.FuzzedDataProvider(data)
    start, end, max_h, max_p = (_hostile_int(fdp) for _ in range(4))
    if fdp.ConsumeBool():  # mostly ranges inside the buffer, where the parser runs
        start, end = start % 64, end % (1 << 16)
    buf = fdp.ConsumeBytes(fdp.remaining_bytes())
    try:
        got = _ext(SPEEDUPS).parse_frame(buf, start, end, max_h, max_p)
    except _ARG_ERRORS:
        return
    if got is not None:
        _event, after, _head = got
        if not start < after <= end <= len(buf):
            raise AssertionError(f"parse_frame({start}, {end}) of {len(buf)} bytes -> {after}")


def fuzz_frame_head(data: bytes) -> None:
    """`frame_head` with hostile fields: a documented argument error, or exactly the bytes of
    the Python reference."""
    fdp = atheris.FuzzedDataProvider(data)
    op, rid, plen = (_hostile_int(fdp) for _ in range(3))
    name = fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 40)) if fdp.ConsumeBool() else None
    value: object = (None, True, False, _hostile_int(fdp))[fdp.ConsumeIntInRange(0, 3)]
    try:
        got = _ext(SPEEDUPS).frame_head(op, rid, name, value, plen)
    except _ARG_ERRORS:
        return
    want = fast.py_frame_head(op, rid, name, value, plen)
    if got != want:
        raise AssertionError(f"frame_head{(op, rid, name, value, plen)}: {got!r} != {want!r}")


def fuzz_crc32c_copy(data: bytes) -> None:
    """`crc32c_copy` and `crc32c` with hostile destination sizes, overlapping and strided views
    and CRC seeds: a documented error, or the Python reference's bytes and checksum."""
    fdp = atheris.FuzzedDataProvider(data)
    crc = _hostile_int(fdp)
    src_len, dst_len = fdp.ConsumeIntInRange(0, 4096), fdp.ConsumeIntInRange(0, 4096)
    shared = fdp.ConsumeIntInRange(0, 3)  # 1: dst and src in one buffer (overlap); 2: strided
    payload = fdp.ConsumeBytes(src_len)
    # Exact-size heap blocks (numpy's), so ASan sees a byte read or written past either end;
    # a bytearray keeps a spare byte, and an empty one is a static buffer outside ASan's view.
    src: memoryview = memoryview(np.frombuffer(payload, np.uint8).copy())
    if shared == 1:
        arena = np.zeros(len(payload) + dst_len + 8, np.uint8)
        arena[: len(payload)] = np.frombuffer(payload, np.uint8)
        offset = fdp.ConsumeIntInRange(0, len(arena))
        src, dst = memoryview(arena)[: len(payload)], memoryview(arena)[offset : offset + dst_len]
    else:
        dst = memoryview(np.zeros(dst_len, np.uint8))
        if shared == 2:
            src = src[::2]
    expect = bytearray(dst)
    try:
        got = _ext(SPEEDUPS).crc32c_copy(dst, src, crc)
    except _ARG_ERRORS:
        return
    ref = fast.py_crc32c_copy(expect, bytes(src), crc)
    if got != ref or bytes(dst[: len(src)]) != bytes(src):
        raise AssertionError(f"crc32c_copy: {got:#x} != {ref:#x} or the copy differs")
    if _ext(SPEEDUPS).crc32c(src, crc) != got:
        raise AssertionError("crc32c disagrees with crc32c_copy")


class _FrameStream:
    """`parse_frame` as a receive loop drives it: bytes arrive in chunks, whole frames are
    taken from the front; a frame it leaves to Python (None) is skipped by its declared size."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        parse = _ext(SPEEDUPS).parse_frame
        while len(self.buf) >= 24:
            got = parse(self.buf, 0, len(self.buf), LIMITS.max_header_bytes, 1 << 20)
            if got is None:
                hlen = int.from_bytes(self.buf[12:16], "little")
                if hlen + 24 > len(self.buf):
                    return  # a partial frame, or one the Python codec would refuse
                del self.buf[: 24 + hlen]
            else:
                del self.buf[: got[1]]


def _scalar_seeds() -> list[bytes]:
    return [bytes(range(n)) * 4 for n in (8, 40, 200)] + [b"\xff" * 64, b"\x00" * 64]


# ------------------------------------------------- _speedups through the connection: C = Python
def fuzz_native_differential(data: bytes, role: nw.Role) -> None:
    """One byte stream through a native connection on the C parser and on the Python one: the
    same events, payload bytes and refusal (error type), in the same order."""
    traces = []
    for implementation in ("c", "python"):
        fast.use(implementation)
        try:
            traces.append(_native_trace(data, role))
        finally:
            fast.use("c")
    if traces[0] != traces[1]:
        raise AssertionError(f"C and Python differ:\n{traces[0]}\n{traces[1]}")


def _native_trace(data: bytes, role: nw.Role) -> list[object]:
    _, chunks = _chunks(data)
    conn = nw.NativeConnection(role, LIMITS)
    if role is nw.Role.CLIENT:
        for event, payload in _CLIENT_REQUESTS:
            conn.send(event, payload)
    trace: list[object] = []
    try:
        for chunk in [*chunks, b""]:
            conn.receive_data(chunk)
            while True:
                event = conn.next_event()
                trace.append(event)
                if event is nw.NEED_DATA or isinstance(event, nw.ConnectionClosed):
                    break
                if isinstance(event, nw.Event) and event.payload_length:
                    sink = bytearray(event.payload_length)
                    conn.set_payload_sink([memoryview(sink)])
                    trace.append(sink)
    except RemoteProtocolError as exc:
        trace.append(type(exc).__name__)
    return trace


# ---------------------------------------------------------------------------- the table
TARGETS: dict[str, Target] = {
    "parse-frame": Target(fuzz_parse_frame, lambda: native_seeds(nw.Role.SERVER), SPEEDUPS, 0.25),
    "frame-head": Target(fuzz_frame_head, _scalar_seeds, SPEEDUPS, 0.1),
    "crc32c-copy": Target(fuzz_crc32c_copy, _scalar_seeds, SPEEDUPS, 0.15),
    "frame-stream": stream_target(
        _FrameStream,
        _FrameStream.feed,
        module=SPEEDUPS,
        seeds=lambda: native_seeds(nw.Role.SERVER),
        errors=(),
        share=0.1,
    ),
    "native-server-c": Target(
        lambda d: fuzz_native_differential(d, nw.Role.SERVER),
        lambda: native_seeds(nw.Role.SERVER),
        SPEEDUPS,
        0.3,
    ),
    "native-client-c": Target(
        lambda d: fuzz_native_differential(d, nw.Role.CLIENT),
        lambda: native_seeds(nw.Role.CLIENT),
        SPEEDUPS,
        0.2,
    ),
}


def asan_self_test(data: bytes) -> None:
    """Writes one byte past an exact heap block, through an intercepted memmove: the proof that
    a run under sanitized.py reports what ASan finds (its test expects this to fail)."""
    block = np.zeros(16, np.uint8)
    ctypes.memmove(block.ctypes.data + 16, data[:1] or b"x", 1)


# Not in TARGETS (never run by default): what the runner's own test runs to see it fail.
SELF_TESTS: dict[str, Target] = {
    "asan-self-test": Target(asan_self_test, lambda: [b"x"], SPEEDUPS, 1.0),
}


def _ext(name: str) -> Any:
    return SANITIZED[name] if name in SANITIZED else importlib.import_module(name)


def check_build(target: Target) -> None:
    """Refuse to fuzz anything but the sanitized build (the normal one when exploring), and
    for _speedups anything but its C path."""
    if EXPLORE:
        _ext(target.module)  # an ImportError: the extension did not build
    elif target.module not in SANITIZED:
        raise SystemExit(f"{target.module} is not in the sanitized build {sorted(SANITIZED)}")
    if target.module == SPEEDUPS and fast._EXT is not _ext(SPEEDUPS):
        raise SystemExit("kvoffload.wire.fast did not bind the _speedups under test")


def write_seeds(name: str, directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    seeds = {**TARGETS, **SELF_TESTS}[name].seeds()
    for i, seed in enumerate(seeds):
        (directory / f"seed-{i:03d}").write_bytes(seed)
    return len(seeds)


def main(argv: Sequence[str]) -> None:
    if argv[1:2] == ["--list"]:  # for sanitized.py, which does not import this
        for name, target in TARGETS.items():
            print(name, target.share)
        return
    if argv[1:2] == ["--seeds"]:
        print(write_seeds(argv[2], Path(argv[3])))
        return
    target = {**TARGETS, **SELF_TESTS}[argv[1]]
    check_build(target)
    atheris.Setup([argv[0], *argv[2:]], target.fuzz)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
