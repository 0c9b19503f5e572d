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

The C core's targets (`hot-gets`, `dram-index`) read their input as choices, not as one byte
stream: which frames or operations, which limits, which chunking. Adding a target (GetMany or
puts in C, the C reader callback): write `fuzz(data: bytes) -> None` and a seed list, or for
a C object that consumes a byte stream use `stream_target`, and add the `Target` to TARGETS;
`sanitized.py` and its test pick every entry up (`share` of the runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import importlib
import importlib.machinery
import importlib.util
import math
import os
import select
import socket
import struct
import sys
import tempfile
import termios
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
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

import msgpack  # noqa: E402

# fuzz_codecs imports the project under atheris's instrumentation; these names are its.
from fuzz_codecs import _CLIENT_REQUESTS, LIMITS, _chunks, native_seeds  # noqa: E402

from kvoffload import core  # noqa: E402
from kvoffload.errors import KVOffloadError, LocalProtocolError, RemoteProtocolError  # noqa: E402
from kvoffload.kvstore import DramConfig, Engine, EngineConfig  # noqa: E402
from kvoffload.kvstore.arena import AlignedBuffer  # noqa: E402
from kvoffload.kvstore.dram import DramEntry, DramIndex  # noqa: E402
from kvoffload.nvmeof_target.services import PinBudget  # noqa: E402
from kvoffload.nvmeof_target.tenants import Tenant  # noqa: E402
from kvoffload.wire import fast  # noqa: E402
from kvoffload.wire.native import connection as nw  # noqa: E402
from kvoffload.wire.native.connection import (  # noqa: E402
    NEED_DATA,
    Exists,
    Get,
    GetMany,
    GetManyResult,
    Hello,
    Limits,
    Lookup,
    LookupResult,
    NativeConnection,
    Put,
    Role,
    Welcome,
)
from kvoffload.wire.native.frames import (  # noqa: E402
    FRAME,
    MAGIC,
    Frame,
    FrameReader,
    Need,
    _State,
    encode_frame,  # noqa: E402
)
from kvoffload.wire.shards import shard_of  # noqa: E402
from kvoffload.wire.status import Status  # noqa: E402
from kvoffload.wire.tiers import wire_pairs  # noqa: E402


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


# ------------------------------------------ _speedups_net: one exchange with a hostile daemon
# Each input: _NET_PARAMS bytes of the near end's choices, then what the daemon answers. The
# far end of a socketpair writes the answer in the chosen chunk sizes (each one read before
# the next is written, so C sees those boundaries), then closes or stalls; the C call runs
# on the near end, non-blocking as sync.py leaves it. Its outcome must be exactly what the
# Python codec derives from the same bytes, or a hand-back as _speedups_net.c documents it.
_NET_PARAMS = 12  # mode, request id (4), buffer size (2), size mask, chunk codes (4)
_NET_CHUNKS = (1, 2, 3, 7, 23, 24, 25, 97, 120, 487, 512, 513, 4096, 1 << 20)
_SENTINEL = 0xA5  # what the caller's buffers hold before the call
_HANG = 10.0  # a deadline an exchange that ends in EOF never reaches
_STALL = 0.02  # the deadline when the daemon stalls
# The client's limits (session.py's): what the C calls accept, the codec must too.
_CLIENT_LIMITS = nw.Limits(
    max_header_bytes=64 << 20, max_payload_bytes=4 << 30, max_pending=1 << 16
)
_NET_KEYS = [i.to_bytes(2, "little") * 8 for i in range(1, 258)]
# A batch's size by the mode's high nibble: 1 to 14 keys, then fast.NET_MAX_KEYS and one more.
_COUNTS = (*range(1, 15), 256, 257)


@dataclass(frozen=True)
class _NetInput:
    stall: bool  # no EOF after the answer: the deadline ends the call
    prebuilt: bool  # get_into: the Get frame from Python, not built by C from the key
    header: int  # the header buffers' size (96 is right)
    count: int  # keys of a get_many_into (_COUNTS), of a put_many (at most 14)
    rid: int  # the request id passed (_wrap_rid: the high bits of the last two chunk codes)
    size: int  # payload buffer size
    mask: int  # get_many_into: buffer i is half-size when bit i % 7 is set; put: PutMany
    nan: bool  # a NaN timeout (mask's bit 7), which must be refused
    chunks: list[bytes]
    stream: bytes


def _net_input(data: bytes) -> _NetInput:
    p = data[:_NET_PARAMS].ljust(_NET_PARAMS, b"\0")
    stream = data[_NET_PARAMS:]
    chunks, at = [], 0
    for code in p[8:12]:
        size = _NET_CHUNKS[(code & 0x7F) % len(_NET_CHUNKS)]
        chunks.append(stream[at : at + size])
        at += size
    chunks.append(stream[at:])
    return _NetInput(
        stall=bool(p[0] & 1),
        prebuilt=bool(p[0] & 2),
        header=(96, 96, 200, 95)[(p[0] >> 2) & 3],
        count=_COUNTS[p[0] >> 4],
        rid=_wrap_rid(int.from_bytes(p[1:5], "little"), p[10] >> 7 | p[11] >> 7 << 1),
        size=int.from_bytes(p[5:7], "little"),
        mask=p[7] & 0x7F,
        nan=bool(p[7] & 0x80),
        chunks=[c for c in chunks if c],
        stream=stream,
    )


def _wrap_rid(rid: int, how: int) -> int:
    """The request id as the caller passes it: mostly as is, else past 32 or 64 bits or
    negative (each must be refused, not wrapped onto a real id)."""
    return (rid, rid + (1 << 32), rid + (1 << 64), -rid)[how]


def _net_params(
    rid: int,
    *,
    stall: bool = False,
    prebuilt: bool = False,
    count: int = 1,
    size: int = 4096,
    mask: int = 0,
    chunks: bytes = b"\x0d\x0d\x0d\x0d",
) -> bytes:
    mode = int(stall) | int(prebuilt) << 1 | _COUNTS.index(count) << 4
    return (
        bytes([mode])
        + rid.to_bytes(4, "little")
        + size.to_bytes(2, "little")
        + bytes([mask])
        + chunks
    )


def _serve(far: socket.socket, near: socket.socket, inp: _NetInput, done: threading.Event) -> None:
    """The hostile daemon: each chunk once the near end has read the one before (FIONREAD
    0) or the call has returned, then EOF unless it stalls."""
    for chunk in inp.chunks:
        far.sendall(chunk)  # inputs are far below a socketpair's buffer: never blocks
        while _unread(near) and not done.wait(0.0002):
            pass
    if not inp.stall:
        far.shutdown(socket.SHUT_WR)


def _unread(sock: socket.socket) -> int:
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)), "little")


def _exchange(inp: _NetInput, call: Callable[[int, float], Any]) -> tuple[Any, bytes]:
    """`call(fd, timeout)` against the hostile daemon: its result (or its exception) and the
    bytes it sent."""
    near, far = socket.socketpair()
    with near, far:
        near.setblocking(False)
        done = threading.Event()
        writer = threading.Thread(target=_serve, args=(far, near, inp, done))
        writer.start()
        timeout = math.nan if inp.nan else _STALL if inp.stall else _HANG
        try:
            result: Any = call(near.fileno(), timeout)
        except (*_ARG_ERRORS, TimeoutError, OSError) as exc:
            result = exc
        finally:
            done.set()
            writer.join()
        far.setblocking(False)
        sent = b""
        with contextlib.suppress(BlockingIOError):
            while got := far.recv(1 << 16):
                sent += got
    if isinstance(result, TimeoutError) and not inp.stall:
        raise AssertionError("the call timed out though the daemon closed the connection")
    if isinstance(result, OSError) and not isinstance(result, TimeoutError):
        raise AssertionError(f"an OSError on a healthy socketpair: {result!r}")
    return result, sent


@dataclass
class _Reference:
    """What the Python codec makes of the stream after sending `request` (its first answer
    for it, the payload, or why there is none: "answer", "short", "error" or "other")."""

    kind: str
    event: object = None
    payload: bytes = b""


def _reference(request: nw.Event, payload: list[bytes], inp: _NetInput) -> _Reference:
    previous = fast.use("python")
    try:
        conn = nw.NativeConnection(nw.Role.CLIENT, _CLIENT_LIMITS)
        conn.send(nw.Hello(1 if request.request_id != 1 else 2), [])
        conn.send(request, payload)
        conn.receive_data(inp.stream)
        if not inp.stall:
            conn.receive_eof()
        try:
            event = conn.next_event()
            if event is nw.NEED_DATA:
                return _Reference("short")
            if not isinstance(event, nw.Event) or event.request_id != request.request_id:
                return _Reference("other", event)
            if isinstance(event, nw.ErrorReply):
                return _Reference("other", event)
            sink = bytearray(event.payload_length)
            if sink:
                conn.set_payload_sink([memoryview(sink)])
                end = conn.next_event()
                if end is nw.NEED_DATA:
                    return _Reference("short", event)
            return _Reference("answer", event, bytes(sink))
        except RemoteProtocolError:
            return _Reference("error")
    finally:
        fast.use(previous)


def _buffer(size: int) -> np.ndarray:
    """An exact heap block (ASan sees a byte past it) holding the sentinel."""
    return np.full(size, _SENTINEL, np.uint8)


def _untouched(buf: np.ndarray, start: int = 0) -> bool:
    return bool((buf[start:] == _SENTINEL).all())


def _zeroed_or_untouched(buf: np.ndarray) -> bool:
    """After a failure: the bytes that landed zeroed (a prefix), the rest as they were."""
    nonzero = np.flatnonzero(buf)
    return _untouched(buf, int(nonzero[0])) if len(nonzero) else True


def _refused(got: object, sent: bytes, bad: bool) -> bool:
    """Whether the call refused its arguments: exactly the bad ones (a request id the codec
    could not have numbered, a short header, a NaN timeout), and before sending anything."""
    if isinstance(got, _ARG_ERRORS):
        if not bad or sent:
            raise AssertionError(f"refused good arguments, or after sending: {got!r}")
        return True
    if bad:
        raise AssertionError(f"bad arguments were not refused: {got!r}")
    return False


def _check_handed_back(answer: tuple[Any, ...], inp: _NetInput) -> None:
    """FALLBACK: at most a head read's bytes, a prefix of the stream; eof only after all."""
    _status, _, _, eof, data = answer
    if len(data) > 512 or not inp.stream.startswith(data):
        raise AssertionError(f"handed back {len(data)} bytes that are not the stream's start")
    if eof and (inp.stall or data != inp.stream):
        raise AssertionError("eof handed back before the daemon closed")


def _check_leftover(data: bytes, inp: _NetInput) -> None:
    """DONE: what came back is what follows the answer's frame in the stream."""
    hlen, plen = struct.unpack_from("<IQ", inp.stream, 12)
    end = 24 + hlen + plen
    if inp.stream[end : end + len(data)] != data:
        raise AssertionError("the bytes past the answer are not the stream's")


def fuzz_net_get_into(data: bytes) -> None:
    """`net_get_into` against a hostile daemon: the block the Python codec reads from the same
    bytes (header, payload, length, CRC, what follows), a miss, a hand-back, or a cut with
    the landed bytes zeroed; a buffer outside the payload's is never written."""
    inp = _net_input(data)
    key = _NET_KEYS[inp.count - 1]
    header, buffer = _buffer(inp.header), _buffer(inp.size)
    request = nw.Get(inp.rid, key) if 0 < inp.rid < 1 << 32 else None
    frame: object = key
    if inp.prebuilt and request is not None:
        frame = b"".join(encode_frame(nw.Get.OP, 0, inp.rid, request.meta()))
    net = _ext(SPEEDUPS).net_get_into
    got, sent = _exchange(inp, lambda fd, t: net(fd, frame, inp.rid, header, buffer, t))
    if _refused(got, sent, request is None or inp.header < 96 or inp.nan):
        return
    assert request is not None
    if sent != b"".join(encode_frame(nw.Get.OP, 0, inp.rid, request.meta())):
        raise AssertionError(f"sent {sent!r}, not the Get frame")
    if isinstance(got, TimeoutError):
        if not _zeroed_or_untouched(buffer):
            raise AssertionError("a timed-out get left bytes in the buffer")
        return
    status, length, crc, eof, rest = got
    if status == fast.NET_FALLBACK:
        _check_handed_back(got, inp)
        if not (_untouched(buffer) and _untouched(header)):
            raise AssertionError("a hand-back wrote the caller's buffers")
        return
    ref = _reference(request, [], inp)
    if status == fast.NET_CUT:
        if got != (fast.NET_CUT, 0, 0, 1, b"") or ref.kind != "error" or inp.stall:
            raise AssertionError(f"cut {got!r} where the codec says {ref}")
        if not _zeroed_or_untouched(buffer):
            raise AssertionError("a cut get left bytes in the buffer")
        return
    if status != fast.NET_DONE or eof or ref.kind != "answer":
        raise AssertionError(f"{got[:4]} where the codec says {ref}")
    _check_leftover(rest, inp)
    if length == -1:
        if ref.event != nw.GetResult(inp.rid, None) or crc != 0 or not _untouched(buffer):
            raise AssertionError(f"a miss where the codec says {ref.event}")
        return
    block = ref.payload
    if ref.event != nw.GetResult(inp.rid, length + 96) or len(block) != length + 96:
        raise AssertionError(f"length {length} where the codec says {ref.event}")
    if bytes(header[:96]) != block[:96] or not _untouched(header, 96):
        raise AssertionError("the block header differs from the codec's")
    if bytes(buffer[:length]) != block[96:] or not _untouched(buffer, length):
        raise AssertionError("the payload differs from the codec's")
    if crc != fast.py_crc32c(block[96:]):
        raise AssertionError(f"crc {crc:#x} is not the payload's")


def _many_buffers(inp: _NetInput) -> list[np.ndarray]:
    return [
        _buffer(inp.size // 2 if inp.mask >> (i % 7) & 1 else inp.size) for i in range(inp.count)
    ]


def fuzz_net_get_many_into(data: bytes) -> None:
    """`net_get_many_into` against a hostile daemon: every hit and miss as the Python codec
    reads the same bytes, a hand-back, or a cut with every landed payload zeroed."""
    inp = _net_input(data)
    keys = tuple(_NET_KEYS[: inp.count])
    if inp.count > 16:  # 256 buffers of up to 64 KiB each would make every input slow
        inp = replace(inp, size=inp.size % 4096)
    headers = [_buffer(inp.header) for _ in keys]
    buffers = _many_buffers(inp)
    request = nw.GetMany(inp.rid, keys) if 0 < inp.rid < 1 << 32 else None
    rid = inp.rid if request is not None else 1  # the frame needs a valid id to be built
    frame = b"".join(encode_frame(nw.GetMany.OP, 0, rid, nw.GetMany(rid, keys).meta()))
    net = _ext(SPEEDUPS).net_get_many_into
    got, sent = _exchange(
        inp, lambda fd, t: net(fd, frame, inp.rid, list(headers), list(buffers), t)
    )
    bad = request is None or inp.header < 96 or inp.nan or inp.count > fast.NET_MAX_KEYS
    if _refused(got, sent, bad):
        return
    assert request is not None
    if sent != frame:
        raise AssertionError("sent something else than the GetMany frame")
    if isinstance(got, TimeoutError):
        if not all(_zeroed_or_untouched(b) for b in buffers):
            raise AssertionError("a timed-out get_many left bytes in a buffer")
        return
    status, lengths, crcs, eof, rest = got
    if status == fast.NET_FALLBACK:
        _check_handed_back(got, inp)
        if not all(_untouched(b) for b in buffers + headers):
            raise AssertionError("a hand-back wrote the caller's buffers")
        return
    ref = _reference(request, [], inp)
    if status == fast.NET_CUT:
        if got != (fast.NET_CUT, None, None, 1, b"") or ref.kind != "error" or inp.stall:
            raise AssertionError(f"cut {got!r} where the codec says {ref}")
        if not all(_zeroed_or_untouched(b) for b in buffers):
            raise AssertionError("a cut get_many left bytes in a buffer")
        return
    if status != fast.NET_DONE or eof or ref.kind != "answer" or lengths is None or crcs is None:
        raise AssertionError(f"{got[:4]} where the codec says {ref}")
    _check_leftover(rest, inp)
    want = tuple(None if n < 0 else n + 96 for n in lengths)
    if ref.event != nw.GetManyResult(inp.rid, want):
        raise AssertionError(f"lengths {lengths} where the codec says {ref.event}")
    at = 0
    for n, crc, head, buf in zip(lengths, crcs, headers, buffers, strict=True):
        if n < 0:
            if crc != 0 or not (_untouched(head) and _untouched(buf)):
                raise AssertionError("a miss wrote its buffers")
            continue
        block = ref.payload[at : at + n + 96]
        at += n + 96
        if bytes(head[:96]) != block[:96] or not _untouched(head, 96):
            raise AssertionError("a block header differs from the codec's")
        if bytes(buf[:n]) != block[96:] or not _untouched(buf, n):
            raise AssertionError("a payload differs from the codec's")
        if crc != fast.py_crc32c(block[96:]):
            raise AssertionError(f"crc {crc:#x} is not the payload's")


def _put_request(inp: _NetInput, rid: int) -> tuple[nw.Event, list[bytes]]:
    value = bytes(range(256)) * (1 + inp.size % 8)
    if inp.mask & 1:
        # A frame the socket takes whole: the daemon does not read before the call returns.
        keys = tuple(_NET_KEYS[: min(inp.count, 14)])
        return nw.PutMany(rid, keys, (len(value),) * len(keys)), [value] * len(keys)
    return nw.Put(rid, _NET_KEYS[0], len(value)), [value]


def fuzz_net_put(data: bytes) -> None:
    """`net_put` (a Put or a PutMany) against a hostile daemon: done exactly when the Python
    codec reads the expected answer from the same bytes, else a hand-back of what was read."""
    inp = _net_input(data)
    rid = inp.rid if 0 < inp.rid < 1 << 32 else 1
    request, payload = _put_request(inp, rid)
    parts = encode_frame(request.OP, 0, rid, request.meta(), payload)
    net = _ext(SPEEDUPS).net_put
    got, sent = _exchange(inp, lambda fd, t: net(fd, parts, inp.rid, request.OP, t))
    if _refused(got, sent, rid != inp.rid or inp.nan):
        return
    if sent != b"".join(bytes(p) for p in parts):
        raise AssertionError("sent something else than the frame's parts")
    if isinstance(got, TimeoutError):
        return
    status, _, _, eof, rest = got
    if status == fast.NET_FALLBACK:
        _check_handed_back(got, inp)
        return
    ref = _reference(request, payload, inp)
    answer = nw.PutManyDone(rid) if isinstance(request, nw.PutMany) else nw.PutDone(rid)
    if got != (fast.NET_DONE, 0, 0, 0, b"") or ref.event != answer:
        raise AssertionError(f"{got!r} where the codec says {ref}")


_LOOKUP_KEYS = [i.to_bytes(16, "little") for i in range(1, 4098)]


def _lookup_keys(inp: _NetInput) -> Any:
    """The keys a lookup passes: `inp.count` of them, or 15 or 16 (mask bits 5-6 set: the
    array's two encodings), or 4096 or 4097 (bits 0-1 set); duplicates when bit 2 is set, and
    (bit 3) one that C must refuse before sending: 15 bytes, a bytearray, or the whole list a
    list subclass; a list, not a tuple, when bit 4 is set."""
    count = inp.count
    if inp.mask & 0x60 == 0x60:
        count = 15 + (inp.size & 1)
    if inp.mask & 3 == 3:
        count = 4096 + (inp.size & 1)
    keys: list[object] = list(_LOOKUP_KEYS[:count])
    if inp.mask & 4:
        keys = [_LOOKUP_KEYS[i % 3] for i in range(count)]
    if inp.mask & 8:
        at, how = (inp.size >> 1) % count, (inp.size >> 8) % 3
        if how == 2:
            return type("Keys", (list,), {})(keys)
        keys[at] = bytes(15) if how == 0 else bytearray(_LOOKUP_KEYS[0])
    return keys if inp.mask & 16 else tuple(keys)


def fuzz_net_lookup(data: bytes) -> None:
    """`net_lookup` against a hostile daemon: the Lookup frame exactly as `encode_frame` writes
    it (1 to 4096 keys; more, or a key not 16 `bytes`, refused before sending), then the count
    the Python codec reads from the same bytes (a done answer consumed no byte past its
    frame), or a hand-back of a prefix of the stream."""
    inp = _net_input(data)
    keys = _lookup_keys(inp)
    good = type(keys) in (tuple, list) and 1 <= len(keys) <= 4096
    good = good and all(type(k) is bytes and len(k) == 16 for k in keys)
    ok_rid = 0 < inp.rid < 1 << 32
    net = _ext(SPEEDUPS).net_lookup
    left = [b""]

    def call(fd: int, timeout: float) -> Any:
        got = net(fd, keys, inp.rid, timeout)
        left[0] = _drain_near(fd, 0.0 if inp.stall else _HANG)
        return got

    got, sent = _exchange(inp, call)
    if _refused(got, sent, not (good and ok_rid) or inp.nan):
        return
    request = nw.Lookup(inp.rid, tuple(keys))
    if sent != b"".join(encode_frame(nw.Lookup.OP, 0, inp.rid, request.meta())):
        raise AssertionError(f"sent {len(sent)} bytes, not the Lookup frame of {len(keys)} keys")
    if isinstance(got, TimeoutError):
        return
    if not isinstance(got, tuple) or len(got) != 4:
        raise AssertionError(f"net_lookup returned {got!r}")
    status, count, eof, rest = got
    if status == fast.NET_FALLBACK:
        _check_handed_back((status, count, 0, eof, rest), inp)
        if count != 0:
            raise AssertionError(f"a hand-back with count {count}")
        # what C read and what it left unread are the whole stream, in order, for the codec
        if not inp.stall and rest + left[0] != inp.stream:
            raise AssertionError("a hand-back lost or reordered bytes of the stream")
        return
    ref = _reference(request, [], inp)
    if (status, eof, rest) != (fast.NET_DONE, 0, b"") or ref.kind != "answer":
        raise AssertionError(f"{got!r} where the codec says {ref}")
    if ref.event != nw.LookupResult(inp.rid, count) or not 0 <= count <= 4096:
        raise AssertionError(f"count {count} where the codec says {ref.event}")
    # Nothing past the answer's frame was consumed: the rest of the stream (up to EOF, or
    # what had come when the daemon stalls) is still there to read, whole and in order.
    end = 24 + int.from_bytes(inp.stream[12:16], "little")
    rest_ok = left[0] == inp.stream[end:] if not inp.stall else inp.stream[end:].startswith(left[0])
    if not rest_ok:
        raise AssertionError("net_lookup consumed bytes past its answer")


def _drain_near(fd: int, wait: float) -> bytes:
    """What the near end still has to read: until EOF, waiting up to `wait` for each chunk the
    daemon sends once the one before was read (0: what is there now)."""
    out = b""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while poller.poll(int(wait * 1000)):
        try:
            got = os.read(fd, 1 << 16)
        except BlockingIOError:
            continue
        if not got:
            break
        out += got
    return out


def _seed_request(kind: str, inp: _NetInput, rid: int) -> tuple[nw.Event, list[bytes]]:
    if kind == "get":
        return nw.Get(rid, _NET_KEYS[inp.count - 1]), []
    if kind == "many":
        return nw.GetMany(rid, tuple(_NET_KEYS[: inp.count])), []
    if kind == "lookup":
        return nw.Lookup(rid, tuple(_LOOKUP_KEYS[: inp.count])), []
    return _put_request(inp, rid)


def _net_seeds(kind: str) -> list[bytes]:
    """Real daemon answers, as the daemon's codec writes them for the request sent: hits,
    misses, an ErrorReply, a goodbye, an answer and then a goodbye, one numbered 0; each
    whole, in chunks, stalled, into a short buffer, cut in half, with a NaN timeout, with the
    request id plus 2**64."""
    rid, block = 7, bytes(range(256)) * 2
    cases: list[tuple[bytes, nw.Event, list[bytes]]] = []  # (params, answer, its payload)
    counts = {
        "get": [(3, 1)],
        "many": [(3, 1), (256, 0)],
        "put": [(3, 0), (3, 1)],
        "lookup": [(3, 0), (256, 0)],
    }
    for count, mask in counts[kind]:
        params = _net_params(rid, count=count, mask=mask)
        nils: tuple[None, ...] = (None,) * (count - 1)
        by_kind: dict[str, list[tuple[nw.Event, list[bytes]]]] = {
            "get": [(nw.GetResult(rid, len(block)), [block]), (nw.GetResult(rid, None), [])],
            "many": [
                (nw.GetManyResult(rid, (len(block), *nils)), [block]),
                (nw.GetManyResult(rid, (None, *nils)), []),
            ],
            "put": [(nw.PutManyDone(rid) if mask else nw.PutDone(rid), [])],
            # every count width, one past the keys asked, and an answer with tiers
            "lookup": [
                (nw.LookupResult(rid, n), [])
                for n in sorted({0, 2, count, count + 1, 4097, 2**16, 2**32})
            ]
            + [(nw.LookupResult(rid, 2, (1, 2)), [])],
        }
        if kind == "many" and count == 3:
            by_kind["many"].append(
                (nw.GetManyResult(rid, (len(block), None, 96)), [block, block[:96]])
            )
        for event, parts in by_kind[kind] + [
            (nw.ErrorReply(rid, Status.CORRUPT, "checksum"), []),
            (nw.ErrorReply(0, Status.UNAVAILABLE, "shutting down"), []),  # a goodbye
        ]:
            cases.append((params, event, parts))
    seeds = []
    for params, event, parts in cases:
        inp = _net_input(params)
        request, payload = _seed_request(kind, inp, rid)
        # The daemon's codec answers only what it received: the request the exchange sends.
        server = nw.NativeConnection(nw.Role.SERVER, _CLIENT_LIMITS)
        client = nw.NativeConnection(nw.Role.CLIENT, _CLIENT_LIMITS)
        server.receive_data(client.send(nw.Hello(1), []) + client.send(request, payload))
        while server.next_event() is not nw.NEED_DATA:
            pass
        stream = server.send(event, [memoryview(p) for p in parts])
        goodbye = server.send(nw.ErrorReply(0, Status.UNAVAILABLE, "idle"), [])
        for chunks in (b"\x0d\x0d\x0d\x0d", b"\x05\x04\x07\x00", b"\x01\x08\x02\x09"):
            seeds.append(params[:8] + chunks + stream)
        seeds.append(bytes([params[0] | 1]) + params[1:] + stream)  # then a stall
        seeds.append(params[:5] + (100).to_bytes(2, "little") + params[7:] + stream)
        seeds.append(params + stream[: len(stream) // 2])
        seeds.append(params + stream + goodbye)
        # The answer numbered 0, the connection's own id, as the id asked; a NaN timeout.
        seeds.append(params[:1] + bytes(4) + params[5:] + stream[:8] + bytes(4) + stream[12:])
        seeds.append(params[:7] + bytes([params[7] | 0x80]) + params[8:] + stream)
        seeds.append(params[:11] + bytes([params[11] | 0x80]) + stream)  # the id + 2**64
    if kind == "lookup":
        # The first answer for the other key lists (_lookup_keys): 15 and 16 keys, 4096 and
        # 4097, duplicates, a list, a short key, a bytearray, a list subclass.
        first = seeds[0]
        for mask, size in [(0x60, 0), (0x60, 1), (3, 0), (3, 1), (4, 0), (0x10, 0)] + [
            (8, 0),
            (8, 0x100),
            (8, 0x200),
        ]:
            seeds.append(first[:5] + size.to_bytes(2, "little") + bytes([mask]) + first[8:])
    return seeds


# ------------------------------------- _core.HotGets: the daemon's C hot path against Python
CORE = "kvoffload.core._core"
HOT_HELLO = 0xFFFFFFFF  # the reference connection's Hello id
_HOT_KEYS = [bytes([i]) * 16 for i in range(1, 9)]  # the first 5 stored plainly, 3 under alice
_HOT_VALUES = [b"", b"a", bytes(range(256)) * 20, b"v" * 4096, b"w" * 70_001]
_TENANTS = (None, Tenant.named("alice"), Tenant.named("bob"))  # bob: a prefix, no blocks
_GET_MAP = b"\x81\xa3key\xc4\x10"
_OP_GET, _OP_EXISTS, _OP_LOOKUP, _OP_GET_MANY = Get.OP, Exists.OP, Lookup.OP, GetMany.OP
_hot_engine: list[Engine] = []


def _engine() -> Engine:
    """One small DRAM-only engine for the whole run (its state only grows counters and
    touches: gets neither add nor evict)."""
    if not _hot_engine:
        engine = Engine(EngineConfig(dram=DramConfig(capacity_bytes=1 << 20, prefault=False)))
        for key, value in zip(_HOT_KEYS, _HOT_VALUES, strict=False):
            engine.put(key, value)
        alice = _TENANTS[1]
        assert alice is not None
        for key, value in zip(_HOT_KEYS[:3], (b"alice's", b"", b"x" * 300), strict=True):
            engine.put(alice.key(key), value)
        _hot_engine.append(engine)
    return _hot_engine[0]


def _head(op: int, rid: int, hlen: int, plen: int = 0, flags: int = 0) -> bytes:
    return FRAME.pack(MAGIC, 1, op, flags, rid, hlen, plen)


def _lookup_frame(
    rid: int, keys: Sequence[bytes], op: int = _OP_LOOKUP, tiers: bool = False
) -> bytes:
    """A Lookup (or, with `op`, a GetMany: the same map; or a Lookup asking for `tiers`) in
    the canonical encoding."""
    n = len(keys)
    array = bytes([0x90 | n]) if n < 16 else (b"\xdc" + n.to_bytes(2, "big") if n < 65536
                                              else b"\xdd" + n.to_bytes(4, "big"))  # fmt: skip
    body = (b"\x82" if tiers else b"\x81") + b"\xa4keys" + array
    body += b"".join(b"\xc4\x10" + k for k in keys) + (b"\xa5tiers\xc3" if tiers else b"")
    return _head(op, rid, len(body)) + body


@atheris.instrument_func  # coverage of the choices: GCC gives none of the C
def _hot_frame(fdp: atheris.FuzzedDataProvider) -> bytes:
    """One frame of a hostile stream: mostly canonical Gets, Exists, Lookups and GetManys
    (what C takes), and the near misses it must leave to Python."""
    rid = int(fdp.PickValueInList([0, 1, 2, 2, 3, 2**31, 2**32 - 2]))
    key = _HOT_KEYS[fdp.ConsumeIntInRange(0, len(_HOT_KEYS) - 1)]
    kind = fdp.ConsumeIntInRange(0, 11)
    get = _head(_OP_GET if fdp.ConsumeBool() else _OP_EXISTS, rid, 23) + _GET_MAP + key
    if kind <= 2:
        return get
    if kind == 3:
        keys = [_HOT_KEYS[fdp.ConsumeIntInRange(0, 7)] for _ in range(fdp.ConsumeIntInRange(0, 20))]
        which = fdp.ConsumeIntInRange(0, 2)
        return _lookup_frame(rid, keys, _OP_GET_MANY if which == 1 else _OP_LOOKUP, which == 2)
    if kind == 4 and fdp.ConsumeIntInRange(0, 15) == 0:  # rare: each costs ~0.1 s
        count, miss = fdp.ConsumeIntInRange(0, 70_000), fdp.ConsumeIntInRange(0, 70_001)
        return _lookup_frame(rid, [_HOT_KEYS[0 if i != miss else 7] for i in range(count)])
    if kind == 5:  # a field of the head or an early map byte set to a hostile value
        many = _OP_GET_MANY if fdp.ConsumeBool() else _OP_LOOKUP
        frame = bytearray(get if fdp.ConsumeBool() else _lookup_frame(rid, [key, key], many))
        at = fdp.ConsumeIntInRange(4, min(len(frame), 40) - 1)
        if at in (8, 12, 16, 20) and fdp.ConsumeBool():  # id, header or payload length
            frame[at : at + 4] = int(fdp.PickValueInList([0, 1, 22, 24, 2**31, 2**32 - 1])
                                     ).to_bytes(4, "little")  # fmt: skip
        else:
            frame[at] = fdp.ConsumeIntInRange(0, 255)
        return bytes(frame)
    if kind == 6:  # truncated
        return get[: fdp.ConsumeIntInRange(0, len(get) - 1)]
    if kind == 7:  # a valid map C does not take: odd key types, tiers, extra fields
        odd = fdp.PickValueInList([None, 7, -1, "k" * 16, b"", b"k" * 15, b"k" * 17, [key]])
        op = int(fdp.PickValueInList([_OP_GET, _OP_EXISTS, _OP_LOOKUP, _OP_GET_MANY]))
        meta: dict[str, object] = {"keys" if op in (_OP_LOOKUP, _OP_GET_MANY) else "key": odd}
        if fdp.ConsumeBool():
            # tiers false or first: valid, not the client's encoding
            tiers = (
                {"keys": [key], "tiers": False}
                if fdp.ConsumeBool()
                else {"tiers": True, "keys": [key]}
            )
            meta = tiers if op == _OP_LOOKUP else {"key": key, "x": 1}
        body = msgpack.packb(meta)
        return _head(op, rid, len(body)) + body
    if kind == 8:  # a lookup whose array count disagrees with its length
        many = _OP_GET_MANY if fdp.ConsumeBool() else _OP_LOOKUP
        frame = bytearray(_lookup_frame(rid, [key] * fdp.ConsumeIntInRange(0, 17), many))
        frame[30] = fdp.ConsumeIntInRange(0, 255)
        return bytes(frame)
    if kind == 9:  # a request the hot path never takes, with a payload
        body = msgpack.packb({"key": key})
        return _head(1, rid, len(body), 3) + body + b"abc"
    return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))


@dataclass
class _Budget:
    """What a GetMany answered in C may hold: the daemon's pin budget (the real one C takes
    from), the frame's payload limit and the engine's chunk of keys."""

    pins: PinBudget
    max_payload: int
    step: int
    # A worker's (index, count) (`HotGets.set_shard`): C must take no frame naming a key of
    # another shard (`shard_of`); those are the Python session's to refuse WRONG_SHARD.
    shard: tuple[int, int] = (0, 1)


@dataclass
class _HotReference:
    """The Python path's answers to the frames C took, and what they did to the engine."""

    answers: list[bytes]
    counts: list[int]  # gets, exists, lookups, get_manys
    gets: int  # the engine's counters: every key a get or a GetMany's chunk asked for
    hits: int
    hit_bytes: int
    answer_bytes: int  # the hits' bytes the answers carry (a cut-short GetMany carries fewer)
    taken: int  # pin budget bytes the answers hold


def _python_get_many(ref: NativeConnection, engine: Engine, keys: list[bytes], rid: int,
                     budget: _Budget, pins: PinBudget, out: _HotReference) -> None:  # fmt: skip
    """`requests.on_get_many` on a DRAM-only engine, its pin budget played on `pins`."""
    views: list[Any] = []
    taken, stop = 0, False
    for at in range(0, len(keys), budget.step):
        chunk = engine.get_many(keys[at : at + budget.step])
        out.gets += len(chunk)
        out.hits += sum(v is not None for v in chunk)
        out.hit_bytes += sum(len(v) for v in chunk if v is not None)
        for i, view in enumerate(chunk):
            size = len(view) if view is not None else 0
            if view is not None and (
                (views and taken + size > budget.max_payload) or not pins.take(size, taken == 0)
            ):
                for rest in chunk[i:]:
                    if rest is not None:
                        rest.release()
                stop = True
                break
            taken += size
            views.append(view)
        if stop:
            break
    hits = [v for v in views if v is not None]
    lengths = tuple(None if v is None else len(v) for v in views)
    parts = ref.send_parts(GetManyResult(rid, lengths), [v.data for v in hits])
    out.answers.append(b"".join(bytes(p) for p in parts))
    out.answer_bytes += taken
    out.taken += taken
    for view in hits:
        view.release()


@atheris.instrument_func  # coverage of the choices: GCC gives none of the C
def _python_answers(ref: NativeConnection, engine: Engine, tenant: Tenant | None,
                    taken: bytes, budget: _Budget, held_before: int) -> _HotReference:  # fmt: skip
    """What the Python path answers to the frames C took: the codec reads them, the engine's
    own calls answer them (GetMany's pin budget on a copy that starts where C's did)."""
    ref.receive_data(taken)
    out = _HotReference([], [0, 0, 0, 0], 0, 0, 0, 0, 0)
    pins = PinBudget(budget.pins.limit)
    pins.held = held_before
    derive = tenant.key if tenant is not None else (lambda k: k)
    index, count = budget.shard
    while (event := ref.next_event()) is not NEED_DATA:
        keys = event.keys if isinstance(event, (Lookup, GetMany)) else (getattr(event, "key", b""),)
        if count > 1 and any(shard_of(k, count) != index for k in keys):
            raise AssertionError(f"C took {event!r}, which names a key of another shard")
        if isinstance(event, Get):
            view = engine.get(derive(event.key))
            length = None if view is None else len(view)
            parts = ref.send_get_result(event.request_id, length,
                                        (view.data,) if view is not None else ())  # fmt: skip
            out.answers.append(b"".join(bytes(p) for p in parts))
            out.gets += 1
            if view is not None:
                out.hits, out.hit_bytes = out.hits + 1, out.hit_bytes + len(view)
                out.answer_bytes += len(view)
                view.release()
            out.counts[0] += 1
        elif isinstance(event, Exists):
            found = engine.contains(derive(event.key))
            out.answers.append(
                b"".join(bytes(p) for p in ref.send_exists_result(event.request_id, found))
            )
            out.counts[1] += 1
        elif isinstance(event, Lookup):
            where: list[str] | None = [] if event.tiers else None
            n = engine.lookup([derive(k) for k in event.keys], where)
            result = LookupResult(event.request_id, n, None if where is None else wire_pairs(where))
            out.answers.append(b"".join(bytes(p) for p in ref.send_parts(result)))
            out.counts[2] += 1
        elif isinstance(event, GetMany):
            keys = [derive(k) for k in event.keys]
            _python_get_many(ref, engine, keys, event.request_id, budget, pins, out)
            out.counts[3] += 1
        else:
            raise AssertionError(f"C took a frame Python reads as {event!r}")
    return out


def fuzz_hot_gets(data: bytes) -> None:
    """A hostile stream in fuzzed chunks through `HotGets.serve`, with fuzzed limits, turns and
    flow control, Python taking each frame C leaves: what C takes Python reads as the same
    requests and answers with the same bytes and counters, what it leaves is untouched, and no
    pin is left once its answers are released."""
    fdp = atheris.FuzzedDataProvider(data)
    engine, tenant = _engine(), _TENANTS[fdp.ConsumeIntInRange(0, 2)]
    limits = Limits(max_header_bytes=int(fdp.PickValueInList([64, 100, 200, 4096, 4 << 20])),
                    max_payload_bytes=int(fdp.PickValueInList([0, 2, 3, 1 << 20])))  # fmt: skip
    chunk = int(fdp.PickValueInList([1, 7, 24, 47, 100, 4096, 1 << 30]))
    stream = b"".join(_hot_frame(fdp) for _ in range(fdp.ConsumeIntInRange(0, 12)))
    stream += fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
    chunk = max(chunk, len(stream) >> 6)  # a 70,000-key lookup byte by byte: minutes an input
    handles = engine.hot_handles()
    hot_type = core.hot_gets_type()
    assert handles is not None and hot_type is not None
    limit = int(fdp.PickValueInList([0, 100, 5000, 1 << 30]))
    budget = _Budget(PinBudget(limit), int(fdp.PickValueInList([1, 4096, 70_001, 1 << 20])),
                     int(fdp.PickValueInList([1, 2, 3, 64])))  # fmt: skip
    budget.pins.held = start = fdp.ConsumeIntInRange(0, limit)
    hot = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                   handles.apply_touches, handles.free, handles.arena,
                   tenant.hasher if tenant else None, fast.frame_head, _State.HEAD,
                   handles.touch_ring, pins=budget.pins, max_payload=budget.max_payload,
                   step=budget.step)  # fmt: skip
    count = int(fdp.PickValueInList([1, 1, 2, 3]))  # a worker of 2 or 3 (issue 29), or none
    if count > 1:
        budget.shard = (fdp.ConsumeIntInRange(0, count - 1), count)
        hot.set_shard(*budget.shard)
    reader, ref = FrameReader(limits), NativeConnection(Role.SERVER, limits)
    ref.receive_data(NativeConnection(Role.CLIENT).send(Hello(HOT_HELLO)))
    ref.next_event()  # answered, as the session does before it serves in C
    ref.send_parts(Welcome(HOT_HELLO, 1, "", 1 << 20, 1 << 20))
    held: list[tuple[list[object], list[object], int]] = []
    received = 0
    try:
        for at in range(0, len(stream), chunk):
            reader.receive_data(stream[at : at + chunk])
            received = min(len(stream), at + chunk)
            if not _serve_all(fdp, hot, reader, ref, engine, tenant, stream, received, held,
                              budget):  # fmt: skip
                return
    finally:
        for views, entries, taken in held:
            hot.release(views, entries, taken)
        left = [e for e in handles.index.values() if e.pins]
        if left or len(handles.index.pinned):
            raise AssertionError(f"pins left after release: {left}")
        if budget.pins.held != start:
            raise AssertionError(f"pin budget at {budget.pins.held} after release, not {start}")


def _flow(fdp: atheris.FuzzedDataProvider) -> tuple[int, int, int]:
    """serve's (bytes in flight, their limit, turn): mostly roomy; or each hostile; or in
    flight just under a hostile limit (2**63 - 1 among them), with a short turn."""
    mode = fdp.ConsumeIntInRange(0, 5)
    if mode == 0:
        return _hostile_int(fdp), _hostile_int(fdp), _hostile_int(fdp)
    if mode == 1:
        limit = (
            int(fdp.PickValueInList([2**63 - 1, 100])) if fdp.ConsumeBool() else _hostile_int(fdp)
        )
        return limit - fdp.ConsumeIntInRange(0, 200), limit, fdp.ConsumeIntInRange(0, 3)
    return 0, 1 << 30, 1 << 30


@atheris.instrument_func  # coverage of the choices: GCC gives none of the C
def _serve_all(fdp: atheris.FuzzedDataProvider, hot: Any, reader: FrameReader,
               ref: NativeConnection, engine: Engine, tenant: Tenant | None, stream: bytes,
               received: int, held: list[tuple[list[object], list[object], int]],
               budget: _Budget) -> bool:  # fmt: skip
    """Serve what is buffered, C first, Python for each frame C leaves; False once Python
    refuses the stream (the session would close)."""
    handles = engine.hot_handles()
    assert handles is not None
    counters = handles.counters
    while True:
        inflight, max_inflight, most = _flow(fdp)
        pos = received - (reader._end - reader._start)
        before, held_before = dict(counters), budget.pins.held
        try:
            got = hot.serve(reader, inflight, max_inflight, most)
        except (OverflowError, ValueError):
            if all(0 <= v < 2**63 for v in (inflight, max_inflight, most)):
                raise
            got = None
        after = received - (reader._end - reader._start)
        if bytes(reader._buf[reader._start : reader._end]) != stream[after:received]:
            raise AssertionError("HotGets changed the bytes it left")
        if got is not None:
            parts, views, entries, counts, out_bytes, size, taken = got
            held.append((views, entries, taken))
            answer = b"".join(bytes(p) for p in parts)
            if not (after > pos and reader._state is _State.HEAD and size == len(answer)):
                raise AssertionError(f"served {counts} from {pos} to {after}, {size} bytes")
            changed = {k: counters[k] - before[k] for k in ("gets", "hits", "misses", "bytes_out")}
            pinned = budget.pins.held - held_before
            want = _python_answers(ref, engine, tenant, stream[pos:after], budget, held_before)
            # flow control: every answer but the last began under the limit, and the turn
            if (
                sum(map(len, want.answers[:-1])) >= max_inflight - inflight
                or len(want.answers) > most
            ):
                raise AssertionError(
                    f"{len(want.answers)} answers past ({inflight}, {max_inflight}, {most})"
                )
            wrong = list(counts) != want.counts or out_bytes != want.answer_bytes
            if answer != b"".join(want.answers) or wrong:
                raise AssertionError(f"C answered {answer[:200]!r} {counts}, Python "
                                     f"{b''.join(want.answers)[:200]!r} {want.counts}")  # fmt: skip
            if not taken == pinned == want.taken:
                raise AssertionError(f"C holds {taken} ({pinned} taken), Python {want.taken}")
            expect = {"gets": want.gets, "hits": want.hits, "misses": want.gets - want.hits,
                      "bytes_out": want.hit_bytes}  # fmt: skip
            if changed != expect:
                raise AssertionError(f"counters moved by {changed}, Python's by {expect}")
            if fdp.ConsumeBool():  # sometimes at once, sometimes at the end
                hot.release(views, entries, taken)
            continue
        if after != pos:
            raise AssertionError("HotGets moved the reader and answered nothing")
        try:  # Python takes the next frame, as the session would
            event = reader.next_frame()
        except LocalProtocolError:
            return False
        if event is Need.DATA:
            return True
        if isinstance(event, Frame) and event.payload_length:
            reader.discard()


# ------------------------------------------------ _core.DramIndex against kvstore.dram.DramIndex
_INDEX_KEYS = [bytes([i]) * 16 for i in range(5)]
_INDEX_OPS = ("make", "insert", "remove", "lookup", "pin", "unpin", "drain_touches",
              "next_tick", "set_tick", "set_pins", "retire", "contains")  # fmt: skip
_INT64 = range(-(2**63), 2**63)


class _IndexWorld:
    """One index and the entries made for it (numbered in order: the worlds' entries differ)."""

    def __init__(self, index: Any) -> None:
        self.index, self.entries = index, list[DramEntry]()

    def number(self, answer: object) -> object:
        if isinstance(answer, DramEntry):
            return ("entry", next(i for i, e in enumerate(self.entries) if e is answer))
        if isinstance(answer, list):
            return [self.number(a) for a in answer]
        return answer

    def state(self) -> object:
        return ([(e.pins, e.live, e.tick) for e in self.entries], sorted(self.index.pinned),
                self.index.tick, len(self.index), sorted(map(str, map(self.number,
                self.index.values()))), [k in self.index for k in _INDEX_KEYS])  # fmt: skip

    @atheris.instrument_func
    def run(self, op: str, key: int, which: int, value: int) -> object:
        index = self.index
        try:
            if op == "make":
                staging = AlignedBuffer(4096) if value == 1 else None
                self.entries.append(DramEntry(_INDEX_KEYS[key], key * 4096, 100, 4096, None,
                                              index.next_tick(), pins=value % 3,
                                              staging=staging))  # fmt: skip
                return None
            if op in ("lookup", "remove"):
                return self.number(getattr(index, op)(_INDEX_KEYS[key]))
            if op == "contains":
                return _INDEX_KEYS[key] in index
            if op in ("drain_touches", "retire", "next_tick"):
                return self.number(getattr(index, op)())
            if op == "set_tick":
                index.tick = value
                return None
            if not self.entries:
                return "no entry"
            entry = self.entries[which % len(self.entries)]
            if op == "set_pins":  # what the engine may leave: any count, even a negative one
                entry.pins = value
                return None
            return self.number(getattr(index, op)(entry))  # pin, unpin (twice too), insert
        except Exception as exc:  # both must raise the same
            return (type(exc).__name__, str(exc))


_PUT_SOCKETS: list[tuple[socket.socket, socket.socket]] = []  # one pair for the whole run


@atheris.instrument_func  # coverage of the choices: GCC gives none of the C
def fuzz_hot_put_done(data: bytes) -> None:
    """`HotGets.put_done` with fuzzed answers (bytes of any length, or not bytes), start times,
    byte counts and a socket with room for some, none or all of it: the kernel gets a prefix
    and the rest comes back, in order; each call that returns counts exactly one put and its
    bytes, and one that raises (only TypeError, ValueError, OverflowError) counts nothing."""
    fdp = atheris.FuzzedDataProvider(data)
    if not _PUT_SOCKETS:
        near, far = socket.socketpair()
        near.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        near.setblocking(False)
        far.setblocking(False)
        _PUT_SOCKETS.append((near, far))
    near, far = _PUT_SOCKETS[0]
    _drain(far)  # what an earlier input left
    handles = _engine().hot_handles()
    hot_type = core.hot_gets_type()
    assert handles is not None and hot_type is not None
    hot = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                   handles.apply_touches, handles.free, handles.arena, None, fast.frame_head,
                   _State.HEAD, handles.touch_ring, buckets=(1e-3, 1.0))  # fmt: skip
    base_puts = base_in = 0  # a put of nothing counted first: bytes in near 2**63 - 1
    if fdp.ConsumeBool():
        base_in = fdp.ConsumeIntInRange(0, 2**63 - 1)
        if hot.put_done([], near.fileno(), 0.0, base_in) != []:
            raise AssertionError("put_done of nothing left a rest")
        base_puts = 1
    filler = 0  # some, none or all of the socket's room taken first
    with contextlib.suppress(BlockingIOError):
        for _ in range(fdp.ConsumeIntInRange(0, 40)):
            filler += near.send(b"f" * 1024)
    parts: list[object] = [
        fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 9000)) if fdp.ConsumeIntInRange(0, 15)
        else memoryview(b"x")
        for _ in range(fdp.ConsumeIntInRange(0, 4))
    ]  # fmt: skip
    t0 = fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else 0.0
    nbytes = _hostile_int(fdp) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 1 << 40)
    fd = near.fileno() if fdp.ConsumeIntInRange(0, 7) else -1
    try:
        rest = hot.put_done(parts, fd, t0, nbytes)
    except (TypeError, ValueError, OverflowError):
        if all(isinstance(p, bytes) for p in parts) and fd >= 0 and 0 <= nbytes < 2**63 - base_in:
            raise
        if hot.take_metrics()[0] != (0, 0, 0, 0, base_puts) or _drain(far)[filler:]:
            raise AssertionError("a refused put_done counted or sent") from None
        return
    whole = b"".join(p for p in parts if isinstance(p, bytes))
    got = _drain(far)
    if got[:filler] != b"f" * filler or got[filler:] + b"".join(rest) != whole:
        raise AssertionError("put_done sent something other than a prefix of its answer")
    counts, out_bytes, buckets, _, in_bytes = hot.take_metrics()
    puts, total = base_puts + 1, base_in + nbytes
    if counts != (0, 0, 0, 0, puts) or out_bytes or in_bytes != total or sum(buckets[4]) != puts:
        raise AssertionError(f"put_done counted {counts}, {in_bytes} in, not one put of {nbytes}")


def _drain(sock: socket.socket) -> bytes:
    """Everything readable on a non-blocking socket now."""
    got = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := sock.recv(1 << 20):
            got += chunk
    return got


_READER_SOCKETS: list[tuple[socket.socket, socket.socket]] = []  # one pair for the whole run


@atheris.instrument_func  # coverage of the choices: GCC gives none of the C
def fuzz_hot_reader(data: bytes) -> None:
    """The reader callback (`HotGets.arm`, then the object called as the event loop calls a
    reader) on a socket pair, a hostile stream sent in fuzzed chunks, Python reading what it
    hands back as the session does: each call receives once into the codec's buffer and either
    stays armed with all of it answered or hands back once with what it did not answer left as
    the stream's next bytes; what it answered on the socket (and in what it could not send) is
    what the Python path answers to the frames it took; no pin is left once released."""
    fdp = atheris.FuzzedDataProvider(data)
    if not _READER_SOCKETS:
        near, far = socket.socketpair()  # near: the daemon's side
        for sock in (near, far):
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # full sockets happen
        _READER_SOCKETS.append((near, far))
    near, far = _READER_SOCKETS[0]
    _drain(near), _drain(far)  # what an earlier input left
    engine, tenant = _engine(), _TENANTS[fdp.ConsumeIntInRange(0, 2)]
    limits = Limits(max_header_bytes=int(fdp.PickValueInList([64, 200, 4096, 4 << 20])),
                    max_payload_bytes=int(fdp.PickValueInList([0, 3, 1 << 20])))  # fmt: skip
    chunk = int(fdp.PickValueInList([1, 7, 24, 47, 100, 4096, 1 << 30]))
    stream = b"".join(_hot_frame(fdp) for _ in range(fdp.ConsumeIntInRange(0, 12)))
    chunk = max(chunk, len(stream) >> 6)
    handles = engine.hot_handles()
    hot_type = core.hot_gets_type()
    assert handles is not None and hot_type is not None
    limit = int(fdp.PickValueInList([0, 5000, 1 << 30]))
    budget = _Budget(PinBudget(limit), int(fdp.PickValueInList([1, 70_001, 1 << 20])),
                     int(fdp.PickValueInList([1, 3, 64])))  # fmt: skip
    hot = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                   handles.apply_touches, handles.free, handles.arena,
                   tenant.hasher if tenant else None, fast.frame_head, _State.HEAD,
                   handles.touch_ring, buckets=(1e-3, 1.0), pins=budget.pins,
                   max_payload=budget.max_payload, step=budget.step)  # fmt: skip
    most = fdp.ConsumeIntInRange(1, 9)
    max_inflight = int(fdp.PickValueInList([1, 100, 5000, 1 << 30]))
    reader, ref = FrameReader(limits), NativeConnection(Role.SERVER, limits)
    ref.receive_data(NativeConnection(Role.CLIENT).send(Hello(HOT_HELLO)))
    ref.next_event()
    ref.send_parts(Welcome(HOT_HELLO, 1, "", 1 << 20, 1 << 20))
    services = SimpleNamespace(hot_gets=0, hot_exists=0, hot_lookups=0, hot_get_manys=0,
                               hot_reader_requests=0)  # fmt: skip
    backs: list[tuple[int, object, Any]] = []
    held: list[tuple[list[object], list[object], int]] = []
    sent = received = 0
    try:
        while True:
            with contextlib.suppress(BlockingIOError):
                if sent < len(stream):
                    sent += far.send(stream[sent : sent + chunk])
            if reader.at_boundary:  # where the session arms it
                reader.get_buffer()
                at, held_before = received, budget.pins.held
                hot.arm(reader, near.fileno(), most, max_inflight,
                        lambda *back: backs.append(back), services)  # fmt: skip
                hot()
                event_at = received  # where this event's bytes start in the stream
                received += reader._end  # it received at the buffer's front
                # More readable events while armed (the steady state: each starts the buffer
                # over at its front), unless the session disarms (a stop) between two.
                for _ in range(fdp.ConsumeIntInRange(0, 4)):
                    if not hot.armed or fdp.ConsumeBool():
                        break
                    if reader._start != reader._end:
                        raise AssertionError("armed still, with bytes it did not answer")
                    with contextlib.suppress(BlockingIOError):
                        if sent < len(stream):
                            sent += far.send(stream[sent : sent + chunk])
                    hot()
                    event_at = received
                    received += reader._end
                if hot.armed:
                    hot.disarm()
                    hot()  # a disarmed callback the loop still calls: reads nothing
                    if reader._start != reader._end:
                        raise AssertionError("armed still, with bytes it did not answer")
                    if at == received and sent == len(stream):
                        return  # all sent, all read
                elif len(backs) != 1 or backs[0][0] != 0:
                    raise AssertionError(f"handed back {backs}")
                if (
                    bytes(reader._buf[reader._start : reader._end])
                    != stream[event_at + reader._start : received]
                ):
                    raise AssertionError("the reader left other bytes than the stream's")
                got = backs.pop()[2] if backs else None
                answer = _drain(far)
                if got is not None:
                    held.append((got[1], got[2], got[6]))
                    answer += b"".join(bytes(p) for p in got[0])
                took = stream[at : event_at + reader._start]
                want = (_python_answers(ref, engine, tenant, took, budget, held_before)
                        if took else _HotReference([], [0] * 4, 0, 0, 0, 0, 0))  # fmt: skip
                if answer != b"".join(want.answers):
                    raise AssertionError(f"C answered {answer[:200]!r}, Python "
                                         f"{b''.join(want.answers)[:200]!r}")  # fmt: skip
                if services.hot_reader_requests != sum(
                    (services.hot_gets, services.hot_exists, services.hot_lookups,
                     services.hot_get_manys)):  # fmt: skip
                    raise AssertionError(f"counted {services}")
                if reader._start == reader._end:
                    continue
            else:  # inside a frame: the Python read loop's own read
                try:
                    more = near.recv(1 << 16)
                except BlockingIOError:
                    if sent == len(stream):
                        return  # a partial frame at the end: nothing more comes
                    continue
                reader.receive_data(more)
                received += len(more)
            if not _serve_all(fdp, hot, reader, ref, engine, tenant, stream, received, held,
                              budget):  # fmt: skip
                return
    finally:
        hot.disarm()
        for views, entries, taken in held:
            hot.release(views, entries, taken)
        left = [e for e in handles.index.values() if e.pins]
        if left or len(handles.index.pinned) or budget.pins.held:
            raise AssertionError(f"pins left after release: {left}, budget {budget.pins.held}")


_put_engines: list[Engine] = []  # the C reader's engine and the reference, for the whole run


def _put_frame(fdp: atheris.FuzzedDataProvider, rid: int) -> tuple[bytes, bytes | None, bytes]:
    """One frame of a put stream and, for a canonical Put (what C takes), its value; the near
    misses (durable, empty, block metadata, a map that says another length, flags) go back;
    its key."""
    key = _HOT_KEYS[fdp.ConsumeIntInRange(0, 7)]
    value = bytes([rid & 0xFF]) * int(fdp.PickValueInList([1, 3, 100, 4096, 65_536, 70_001]))
    parent = _HOT_KEYS[fdp.ConsumeIntInRange(0, 7)] if fdp.ConsumeBool() else None
    meta: dict[str, object] = {"key": key, "length": len(value), "parent": parent,
                               "durable": False}  # fmt: skip
    kind = fdp.ConsumeIntInRange(0, 15)
    if kind >= 5:
        return b"".join(encode_frame(Put.OP, 0, rid, meta, [value])), value, key
    if kind == 0:  # a response's flag: not a request at all
        return b"".join(encode_frame(Put.OP, 1, rid, meta, [value])), None, key
    if kind == 1:
        meta["durable"] = True
    elif kind == 2:
        meta["length"], value = 0, b""
    elif kind == 3:
        meta["block_meta"] = b"m" * 24
    else:  # the map's length is not the frame's payload length: Python's protocol error
        meta["length"] = len(value) + 1
    return b"".join(encode_frame(Put.OP, 0, rid, meta, [value])), None, key


@atheris.instrument_func  # coverage of the choices: GCC gives none of the C
def fuzz_hot_reader_puts(data: bytes) -> None:
    """The reader callback taking puts (`HotGets.take_puts`) on a socket pair: a stream of
    canonical Puts and near misses sent in fuzzed chunks (payloads split across readable
    events). C calls begin only for a canonical Put at the front, copies the buffered bytes
    and receives the rest into the slot (never past it), commits and answers PutDone, and
    hands back at the first frame it does not take with exactly the stream's bytes from there
    left; a put held at a disarm (a stop) comes back through take_put with what it received.
    The engine then holds what a reference engine given the same puts holds (each key's value
    bytes, entries, used bytes), no pin left. In part of the inputs C serves a worker's shard
    (`set_shard`): a Put naming another shard's key is handed back, never begun."""
    fdp = atheris.FuzzedDataProvider(data)
    if not _READER_SOCKETS:
        near, far = socket.socketpair()
        for sock in (near, far):
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        _READER_SOCKETS.append((near, far))
    near, far = _READER_SOCKETS[0]
    _drain(near), _drain(far)
    if not _put_engines:
        _put_engines.extend(
            Engine(EngineConfig(dram=DramConfig(capacity_bytes=1 << 20, prefault=False)))
            for _ in range(2)
        )
    engine, ref = _put_engines
    tenant = _TENANTS[fdp.ConsumeIntInRange(0, 1)]
    me = tenant or Tenant("")
    # before the frames take the input's bytes: a worker of 2 or 3 (issue 29), or none
    count = int(fdp.PickValueInList([1, 2, 3, 1]))
    index = fdp.ConsumeIntInRange(0, count - 1)
    frames = [_put_frame(fdp, rid) for rid in range(1, fdp.ConsumeIntInRange(1, 8) + 1)]
    stream = b"".join(f for f, _, _ in frames)
    chunk = max(int(fdp.PickValueInList([1, 24, 77, 1000, 65_536, 1 << 30])), len(stream) >> 6)
    handles = engine.hot_handles()
    hot_type = core.hot_gets_type()
    assert handles is not None and hot_type is not None
    hot = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                   handles.apply_touches, handles.free, handles.arena, me.hasher,
                   fast.frame_head, _State.HEAD, handles.touch_ring,
                   buckets=(1e-3, 1.0))  # fmt: skip
    if count > 1:
        hot.set_shard(index, count)
    begun: list[tuple[int, bytes, int, bytes | None]] = []
    done: list[int] = []
    refused: list[int] = []
    refuse = fdp.ConsumeIntInRange(0, 3) == 0  # a commit refused: answered in Python

    def begin(rid: int, key: bytes, length: int, parent: bytes | None) -> object:
        begun.append((rid, key, length, parent))
        try:
            r = engine.reserve(me.key(key), length, parent=me.opt_key(parent), tenant=me.name)
        except KVOffloadError:
            refused.append(rid)  # the frame stays in the buffer: C hands back at it
            return None
        return r.buffer, (rid, key, r)

    def commit(token: tuple[int, bytes, Any]) -> bool:
        rid, key, r = token
        if refuse and len(done) == 1:
            r.abort()
            return False
        r.commit()
        done.append(rid)
        return True

    hot.take_puts(begin, commit)
    limits = Limits(max_payload_bytes=int(fdp.PickValueInList([2, 4096, 1 << 20])))
    reader = FrameReader(limits)
    services = SimpleNamespace(hot_gets=0, hot_exists=0, hot_lookups=0, hot_get_manys=0,
                               hot_reader_requests=0, hot_put_answers=0,
                               hot_reader_puts=0)  # fmt: skip
    backs: list[tuple[int, object, Any]] = []
    sent = 0
    reader.get_buffer()
    hot.arm(reader, near.fileno(), 8, 1 << 30, lambda *back: backs.append(back), services)
    held = None
    try:
        for _ in range(4 * len(stream) + 100):  # bounded: every turn sends or receives
            with contextlib.suppress(BlockingIOError):
                if sent < len(stream):
                    sent += far.send(stream[sent : sent + chunk])
            if fdp.ConsumeIntInRange(0, 31) == 0:  # a stop, perhaps mid-payload
                hot.disarm()
                held = hot.take_put()
                break
            hot()
            if not hot.armed:
                held = hot.take_put()
                break
            if sent == len(stream) and not hot.small_read and reader._end == 0:
                with contextlib.suppress(BlockingIOError):
                    if not near.recv(1, socket.MSG_PEEK):
                        break
                    continue
                break  # all sent, all read, nothing held
        # The answers: PutDone for each put C committed, in order (a refused commit answers
        # in Python, which this harness does not run)
        answer = _drain(far)
        want = b"".join(fast.frame_head(Put.OP, rid, None, None, 0) for rid in done)
        if answer != want:
            raise AssertionError(f"C answered {answer[:200]!r}, want {want[:200]!r}")
        # begin only for the canonical Puts at the front, in order, with their fields
        # (and only for this shard's keys: another's is the Python session's to refuse)
        rids = [b[0] for b in begun]
        if rids != list(range(1, len(rids) + 1)) or any(
            frames[rid - 1][1] is None
            or length != len(frames[rid - 1][1] or b"")
            or shard_of(key, count) != index
            for rid, key, length, _ in begun
        ):
            raise AssertionError(f"begin called for {begun} of {[v is None for _, v, _ in frames]}")
        for rid in done:
            value = frames[rid - 1][1] or b""
            ref.put(me.key(begun[rid - 1][1]), value, parent=me.opt_key(begun[rid - 1][3]))
        for key in {k for _, _, k in frames}:  # each key's value: the reference's bytes
            got_view, want_view = engine.get(me.key(key)), ref.get(me.key(key))
            try:
                if (got_view is None) != (want_view is None) or (
                    got_view is not None
                    and want_view is not None
                    and bytes(got_view.data) != bytes(want_view.data)
                ):
                    raise AssertionError(f"key {key.hex()}: engine and reference differ")
            finally:
                for view in (got_view, want_view):
                    if view is not None:
                        view.release()
        if held is not None:
            (rid, _, r), got = held
            if not 0 <= got < len(frames[rid - 1][1] or b""):
                raise AssertionError(f"held put {rid} received {got} bytes")
            r.abort()
            held = None
        elif backs and backs[0][0] == 0 and reader._start != reader._end:
            # what is left starts at the first frame C did not take (a refused one included)
            first = len(begun) - (1 if refused else 0)
            at = sum(len(f) for f, _, _ in frames[:first])
            left = bytes(reader._buf[reader._start : reader._end])
            if left != stream[at : at + len(left)]:
                raise AssertionError("the reader left other bytes than the stream's")
    finally:
        hot.disarm()
        if held is not None:
            held[0][2].abort()
        hot.take_puts(None, None)
    a, b = engine.stats().as_dict()["tiers"][0], ref.stats().as_dict()["tiers"][0]
    if a["pinned"]:
        raise AssertionError(f"pins left: {a['pinned']}")
    if a["entries"] != b["entries"] or a["used_bytes"] != b["used_bytes"]:
        raise AssertionError(f"engine {a} != reference {b}")


@atheris.instrument_func  # coverage of the choices: GCC gives none of the C
def fuzz_dram_index(data: bytes) -> None:
    """The same operation sequence through the C index and the Python one: every answer, error
    and piece of state equal; where a count leaves 64 bits, C refuses with OverflowError."""
    fdp = atheris.FuzzedDataProvider(data)
    c = _IndexWorld(_ext(CORE).DramIndex())
    python = _IndexWorld(DramIndex())
    while fdp.remaining_bytes():
        op = _INDEX_OPS[fdp.ConsumeIntInRange(0, len(_INDEX_OPS) - 1)]
        key, which = fdp.ConsumeIntInRange(0, 4), fdp.ConsumeIntInRange(0, 15)
        value = _hostile_int(fdp) if op.startswith("set") else fdp.ConsumeIntInRange(0, 2)
        if op == "set_tick" and value not in _INT64:
            continue  # a C long long: assigning more is refused (TypeError/OverflowError)
        before = python.state()
        want, got = python.run(op, key, which, value), c.run(op, key, which, value)
        if got != want:
            # C's counts are 64-bit: past them it refuses, with nothing changed
            if isinstance(got, tuple) and got[0] == "OverflowError" and _overflowed(python):
                if c.state() != before:
                    raise AssertionError(f"{op}: C refused but changed its state")
                return
            raise AssertionError(f"{op}({key}, {which}, {value}): C {got!r}, Python {want!r}")
        if c.state() != python.state():
            raise AssertionError(f"{op}: C {c.state()}, Python {python.state()}")


def _overflowed(world: _IndexWorld) -> bool:
    return world.index.tick not in _INT64 or any(e.pins not in _INT64 for e in world.entries)


_RING_FILE = 3 * 4096 + 123  # bytes of the file the ring reads (not a page multiple)
# (ring, file fd, /dev/null fd, contents, scratch fd to write into)
_ring_world: list[tuple[Any, int, int, bytes, int]] = []


def _ring() -> tuple[Any, int, int, bytes, int]:
    """One ring of depth 4 for the run, a file of known bytes opened to read (buffered: any
    offset and length), /dev/null to write to, and a scratch file to write into and read
    back (emptied before each input)."""
    if not _ring_world:
        contents = bytes(range(256)) * (_RING_FILE // 256) + b"t" * (_RING_FILE % 256)
        fd, path = tempfile.mkstemp(prefix="kvoffload-fuzz-ring-")
        os.write(fd, contents)
        os.close(fd)
        rfd = os.open(path, os.O_RDONLY)
        os.unlink(path)
        sfd, spath = tempfile.mkstemp(prefix="kvoffload-fuzz-ring-w-")
        os.unlink(spath)
        _ring_world.append((_ext(CORE).SlotRing(4), rfd, os.open(os.devnull, os.O_WRONLY),
                            contents, sfd))  # fmt: skip
    return _ring_world[0]


# A second ring with the three files and the middle third of `_REG_MEMORY` registered: its
# entries on those files go as fixed files, its buffers inside that third as fixed buffers.
_REG_MEMORY = np.zeros(3 * 16384, np.uint8)
_reg_ring: list[Any] = []


def _registered_ring() -> Any:
    if not _reg_ring:
        _, rfd, wfd, _, sfd = _ring()
        ring = _ext(CORE).SlotRing(4)
        ring.register_files([rfd, wfd, sfd])
        ring.register_memory(memoryview(_REG_MEMORY)[16384:32768])
        _reg_ring.append(ring)
    return _reg_ring[0]


def _ring_buffer(fdp: Any, size: int, cursor: list[int]) -> memoryview:
    """An exact-size heap buffer, or on the registered ring a part of `_REG_MEMORY` after the
    last one (inside the registered third, across its edges or outside it; never overlapping
    another entry's)."""
    if not cursor:
        return memoryview(np.zeros(size, np.uint8))
    start = cursor[0] + fdp.ConsumeIntInRange(0, 2000)
    if start + size > len(_REG_MEMORY):
        return memoryview(np.zeros(size, np.uint8))
    cursor[0] = start + size
    view = memoryview(_REG_MEMORY)[start : start + size]
    view[:] = b"\0" * size
    return view


def fuzz_slot_ring(data: bytes) -> None:
    """`SlotRing.submit` with hostile entries, on a plain ring or on one with registered files
    and memory (buffers in, across the edges of and outside the registered part): reads of a
    known file at any offset (past its
    end, past 2**63) into exact-size heap buffers (ASan sees a byte past either end), writes to
    /dev/null, writes of fuzzed bytes from read-only and exact-size buffers into a scratch
    file at any offset, closed, negative and huge descriptors, read-only buffers to read into,
    odd entry shapes, up to 12 entries through a ring of depth 4, and injected errnos at
    hostile indexes. A documented argument error, or one result per entry: the injected
    -errno, -EBADF for a closed descriptor, exactly what `os.pread` reads there (the bytes
    too), or for a scratch write every byte (read back the same where no other write of the
    batch overlaps it; a hostile offset may be refused with -errno instead)."""
    fdp = atheris.FuzzedDataProvider(data)
    _, rfd, wfd, contents, sfd = _ring()
    registered = fdp.ConsumeBool()
    ring = _registered_ring() if registered else _ring()[0]
    cursor = [16384 - fdp.ConsumeIntInRange(0, 4096)] if registered else []  # near its start
    os.ftruncate(sfd, 0)
    entries: list[Any] = []
    want: list[tuple[str, Any, int, int]] = []  # (kind, buffer, offset, size)
    for _ in range(fdp.ConsumeIntInRange(0, 12)):
        kind = fdp.ConsumeIntInRange(0, 7)
        size = fdp.ConsumeIntInRange(0, 5000)
        off = _hostile_int(fdp) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, _RING_FILE + 9)
        buf = _ring_buffer(fdp, size, cursor)
        if kind == 0:
            entries.append((rfd, off, buf, False))
        elif kind == 1:
            entries.append((wfd, off, buf, True))
        elif kind == 2:
            entries.append((1 << 20, off, buf, False))  # no such descriptor
        elif kind == 3:  # never one this process has open (stdin would block the read)
            fd = _hostile_int(fdp)
            entries.append((fd + (1 << 20) if 0 <= fd < 1 << 20 else fd, off, buf, False))
        elif kind == 4:
            entries.append((rfd, off, bytes(size), False))  # read into a read-only buffer
        elif kind == 5:
            entries.append([rfd, off, buf] if fdp.ConsumeBool() else (rfd, off, buf, 1, 2))
        else:  # a write into the scratch file, from a read-only or an exact-size heap buffer
            payload = fdp.ConsumeBytes(size)
            size = len(payload)
            src: Any = payload
            if kind == 7:  # on the registered ring, perhaps from registered memory
                src = _ring_buffer(fdp, size, cursor)
                src[:] = payload
            buf = memoryview(payload)
            entries.append((sfd, off, src, True))
        names = {0: "file", 1: "null", 6: "write", 7: "write"}
        want.append((names.get(kind, "bad"), buf, off, size))
    fail = [(_hostile_int(fdp) % 16 - 2, fdp.ConsumeIntInRange(-1, 5000))
            for _ in range(fdp.ConsumeIntInRange(0, 3))]  # fmt: skip
    # Now and then the batch's first io_uring_enter fails (EINTR is retried: no effect).
    enter = (0, 0, 0, 0, 0, errno.ENXIO, errno.EBADF, errno.EINTR)[fdp.ConsumeIntInRange(0, 7)]
    try:
        got = ring.submit(entries, 0.0, fail or None, enter)
    except _ARG_ERRORS:
        return
    except OSError as exc:
        _check_broken(ring, exc, enter, sfd, registered)
        return
    if len(got) != len(entries):
        raise AssertionError(f"submit: {len(got)} results for {len(entries)} entries")
    injected = dict(fail)
    spans = [(off, off + size) for kind, _, off, size in want if kind == "write"]
    for i, (kind, buf, off, size) in enumerate(want):
        if kind == "write" and i not in injected:
            if got[i] < 0 and off > _RING_FILE + 9:
                continue  # a hostile offset: refused by the kernel (EFBIG, EINVAL)
            if got[i] != size:
                raise AssertionError(f"entry {i} (write, offset {off}, {size} bytes): {got[i]}")
            alone = sum(a < off + size and off < b for a, b in spans) <= 1
            if alone and os.pread(sfd, size, off) != bytes(buf):
                raise AssertionError(f"entry {i}: the bytes written at {off} do not read back")
            continue
        if i in injected:
            expect = -injected[i]
        elif kind == "file":
            try:
                read = os.pread(rfd, size, off)
            except OSError as exc:  # what the kernel says of that offset, either way
                read, expect = b"", -(exc.errno or 0)
            else:
                expect = len(read)
            if bytes(buf[: len(read)]) != read:
                raise AssertionError(f"entry {i}: the bytes read at {off} differ from pread's")
        else:
            expect = size if kind == "null" else -errno.EBADF
        if got[i] != expect:
            raise AssertionError(f"entry {i} ({kind}, offset {off}, {size} bytes): {got[i]}, "
                                 f"not {expect}")  # fmt: skip


def _check_broken(ring: Any, exc: OSError, enter: int, sfd: int, registered: bool) -> None:
    """A batch whose first enter failed: that errno, the ring broken, nothing of the batch
    sent (the scratch file stays empty, even after another submission on that ring, which is
    refused); the run goes on with a fresh ring."""
    if enter in (0, errno.EINTR) or exc.errno != enter or not ring.broken:
        raise AssertionError(f"submit raised {exc!r} (enter_fail {enter}, broken {ring.broken})")
    try:
        ring.submit([(sfd, 0, b"z" * 4096, True)])
    except OSError as again:
        if again.errno != errno.EIO:
            raise AssertionError(f"a broken ring's submit raised {again!r}, not EIO") from again
    else:
        raise AssertionError("a broken ring ran a submission")
    if os.fstat(sfd).st_size:
        raise AssertionError("an entry queued before the failed enter was sent later")
    if ring.close() is not True:
        raise AssertionError("a broken ring with nothing in flight did not close")
    if registered:
        _reg_ring.clear()  # the next input registers a fresh one
    else:
        world = _ring_world[0]
        _ring_world[0] = (_ext(CORE).SlotRing(4), *world[1:])


def _core_seeds() -> list[bytes]:
    """Both C core targets read their input as choices (FuzzedDataProvider): any bytes do."""
    return [bytes(range(n)) * 4 for n in (8, 40, 200, 256)] + [b"\x00" * 64, b"\x01" * 300]


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
    "net-get-into": Target(fuzz_net_get_into, lambda: _net_seeds("get"), SPEEDUPS, 0.1),
    "net-get-many-into": Target(fuzz_net_get_many_into, lambda: _net_seeds("many"), SPEEDUPS, 0.1),
    "net-put": Target(fuzz_net_put, lambda: _net_seeds("put"), SPEEDUPS, 0.05),
    "net-lookup": Target(fuzz_net_lookup, lambda: _net_seeds("lookup"), SPEEDUPS, 0.02),
    # The C core (kvoffload/core): the daemon's hot path and the index it reads.
    "hot-gets": Target(fuzz_hot_gets, _core_seeds, CORE, 0.25),
    "dram-index": Target(fuzz_dram_index, _core_seeds, CORE, 0.1),
    "hot-put-done": Target(fuzz_hot_put_done, _core_seeds, CORE, 0.1),
    "hot-reader": Target(fuzz_hot_reader, _core_seeds, CORE, 0.2),
    "hot-reader-puts": Target(fuzz_hot_reader_puts, _core_seeds, CORE, 0.15),
    "slot-ring": Target(fuzz_slot_ring, _core_seeds, CORE, 0.1),
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
    if target.module == CORE and core._EXT is not _ext(CORE):
        raise SystemExit("kvoffload.core did not bind the _core under test")


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
