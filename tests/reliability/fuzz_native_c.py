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

import msgpack  # noqa: E402

# fuzz_codecs imports the project under atheris's instrumentation; these names are its.
from fuzz_codecs import _CLIENT_REQUESTS, LIMITS, _chunks, native_seeds  # noqa: E402

from kvoffload import core  # noqa: E402
from kvoffload.errors import KVOffloadError, LocalProtocolError, RemoteProtocolError  # noqa: E402
from kvoffload.kvstore import DramConfig, Engine, EngineConfig  # noqa: E402
from kvoffload.kvstore.arena import AlignedBuffer  # noqa: E402
from kvoffload.kvstore.dram import DramEntry, DramIndex  # noqa: E402
from kvoffload.nvmeof_target.tenants import Tenant  # noqa: E402
from kvoffload.wire import fast  # noqa: E402
from kvoffload.wire.native import connection as nw  # noqa: E402
from kvoffload.wire.native.connection import (  # noqa: E402
    NEED_DATA,
    Exists,
    Get,
    Hello,
    Limits,
    Lookup,
    LookupResult,
    NativeConnection,
    Role,
    Welcome,
)
from kvoffload.wire.native.frames import FRAME, MAGIC, Frame, FrameReader, Need, _State  # noqa: E402


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


# ------------------------------------- _core.HotGets: the daemon's C hot path against Python
CORE = "kvoffload.core._core"
HOT_HELLO = 0xFFFFFFFF  # the reference connection's Hello id
_HOT_KEYS = [bytes([i]) * 16 for i in range(1, 9)]  # the first 5 stored plainly, 3 under alice
_HOT_VALUES = [b"", b"a", bytes(range(256)) * 20, b"v" * 4096, b"w" * 70_001]
_TENANTS = (None, Tenant.named("alice"), Tenant.named("bob"))  # bob: a prefix, no blocks
_GET_MAP = b"\x81\xa3key\xc4\x10"
_OP_GET, _OP_EXISTS, _OP_LOOKUP = Get.OP, Exists.OP, Lookup.OP
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


def _lookup_frame(rid: int, keys: Sequence[bytes]) -> bytes:
    n = len(keys)
    array = bytes([0x90 | n]) if n < 16 else (b"\xdc" + n.to_bytes(2, "big") if n < 65536
                                              else b"\xdd" + n.to_bytes(4, "big"))  # fmt: skip
    body = b"\x81\xa4keys" + array + b"".join(b"\xc4\x10" + k for k in keys)
    return _head(_OP_LOOKUP, rid, len(body)) + body


@atheris.instrument_func  # coverage of the choices: GCC gives none of the C
def _hot_frame(fdp: atheris.FuzzedDataProvider) -> bytes:
    """One frame of a hostile stream: mostly canonical Gets, Exists and Lookups (what C
    takes), and the near misses it must leave to Python."""
    rid = int(fdp.PickValueInList([0, 1, 2, 2, 3, 2**31, 2**32 - 2]))
    key = _HOT_KEYS[fdp.ConsumeIntInRange(0, len(_HOT_KEYS) - 1)]
    kind = fdp.ConsumeIntInRange(0, 11)
    get = _head(_OP_GET if fdp.ConsumeBool() else _OP_EXISTS, rid, 23) + _GET_MAP + key
    if kind <= 2:
        return get
    if kind == 3:
        keys = [_HOT_KEYS[fdp.ConsumeIntInRange(0, 7)] for _ in range(fdp.ConsumeIntInRange(0, 20))]
        return _lookup_frame(rid, keys)
    if kind == 4 and fdp.ConsumeIntInRange(0, 15) == 0:  # rare: each costs ~0.1 s
        count, miss = fdp.ConsumeIntInRange(0, 70_000), fdp.ConsumeIntInRange(0, 70_001)
        return _lookup_frame(rid, [_HOT_KEYS[0 if i != miss else 7] for i in range(count)])
    if kind == 5:  # a field of the head or an early map byte set to a hostile value
        frame = bytearray(get if fdp.ConsumeBool() else _lookup_frame(rid, [key, key]))
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
        op = int(fdp.PickValueInList([_OP_GET, _OP_EXISTS, _OP_LOOKUP]))
        meta: dict[str, object] = {"keys" if op == _OP_LOOKUP else "key": odd}
        if fdp.ConsumeBool():
            meta = {"keys": [key], "tiers": True} if op == _OP_LOOKUP else {"key": key, "x": 1}
        body = msgpack.packb(meta)
        return _head(op, rid, len(body)) + body
    if kind == 8:  # a lookup whose array count disagrees with its length
        frame = bytearray(_lookup_frame(rid, [key] * fdp.ConsumeIntInRange(0, 17)))
        frame[30] = fdp.ConsumeIntInRange(0, 255)
        return bytes(frame)
    if kind == 9:  # a request the hot path never takes, with a payload
        body = msgpack.packb({"key": key})
        return _head(1, rid, len(body), 3) + body + b"abc"
    return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))


@atheris.instrument_func  # coverage of the choices: GCC gives none of the C
def _python_answers(ref: NativeConnection, engine: Engine, tenant: Tenant | None,
                    taken: bytes) -> tuple[list[bytes], list[int], int, int]:  # fmt: skip
    """What the Python path answers to the frames C took: the codec reads them, the engine's
    own calls answer them. Returns each answer's bytes, (gets, exists, lookups), hits, bytes."""
    ref.receive_data(taken)
    out: list[bytes] = []
    counts, hits, size = [0, 0, 0], 0, 0
    derive = tenant.key if tenant is not None else (lambda k: k)
    while (event := ref.next_event()) is not NEED_DATA:
        if isinstance(event, Get):
            view = engine.get(derive(event.key))
            length = None if view is None else len(view)
            parts = ref.send_get_result(event.request_id, length,
                                        (view.data,) if view is not None else ())  # fmt: skip
            out.append(b"".join(bytes(p) for p in parts))
            if view is not None:
                hits, size = hits + 1, size + len(view)
                view.release()
            counts[0] += 1
        elif isinstance(event, Exists):
            found = engine.contains(derive(event.key))
            out.append(b"".join(bytes(p) for p in ref.send_exists_result(event.request_id, found)))
            counts[1] += 1
        elif isinstance(event, Lookup) and not event.tiers:
            n = engine.lookup([derive(k) for k in event.keys])
            out.append(
                b"".join(bytes(p) for p in ref.send_parts(LookupResult(event.request_id, n)))
            )
            counts[2] += 1
        else:
            raise AssertionError(f"C took a frame Python reads as {event!r}")
    return out, counts, hits, size


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
    hot = hot_type(handles.lock, handles.index, handles.counters, handles.manager,
                   handles.apply_touches, handles.free, handles.arena,
                   tenant.hasher if tenant else None, fast.frame_head, _State.HEAD,
                   handles.touch_ring)  # fmt: skip
    reader, ref = FrameReader(limits), NativeConnection(Role.SERVER, limits)
    ref.receive_data(NativeConnection(Role.CLIENT).send(Hello(HOT_HELLO)))
    ref.next_event()  # answered, as the session does before it serves in C
    ref.send_parts(Welcome(HOT_HELLO, 1, "", 1 << 20, 1 << 20))
    held: list[tuple[list[object], list[object]]] = []
    received = 0
    try:
        for at in range(0, len(stream), chunk):
            reader.receive_data(stream[at : at + chunk])
            received = min(len(stream), at + chunk)
            if not _serve_all(fdp, hot, reader, ref, engine, tenant, stream, received, held):
                return
    finally:
        for views, entries in held:
            hot.release(views, entries)
        left = [e for e in handles.index.values() if e.pins]
        if left or len(handles.index.pinned):
            raise AssertionError(f"pins left after release: {left}")


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
               received: int, held: list[tuple[list[object], list[object]]]) -> bool:  # fmt: skip
    """Serve what is buffered, C first, Python for each frame C leaves; False once Python
    refuses the stream (the session would close)."""
    handles = engine.hot_handles()
    assert handles is not None
    counters = handles.counters
    while True:
        inflight, max_inflight, most = _flow(fdp)
        pos = received - (reader._end - reader._start)
        before = dict(counters)
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
            parts, views, entries, counts, out_bytes, size = got
            held.append((views, entries))
            answer = b"".join(bytes(p) for p in parts)
            if not (after > pos and reader._state is _State.HEAD and size == len(answer)):
                raise AssertionError(f"served {counts} from {pos} to {after}, {size} bytes")
            changed = {k: counters[k] - before[k] for k in ("gets", "hits", "misses", "bytes_out")}
            want, want_counts, hits, hit_bytes = _python_answers(ref, engine, tenant,
                                                                 stream[pos:after])  # fmt: skip
            # flow control: every answer but the last began under the limit, and the turn
            if sum(map(len, want[:-1])) >= max_inflight - inflight or len(want) > most:
                raise AssertionError(
                    f"{len(want)} answers past ({inflight}, {max_inflight}, {most})"
                )
            if answer != b"".join(want) or list(counts) != want_counts or out_bytes != hit_bytes:
                raise AssertionError(f"C answered {answer[:200]!r} {counts}, Python "
                                     f"{b''.join(want)[:200]!r} {want_counts}")  # fmt: skip
            expect = {"gets": want_counts[0], "hits": hits, "misses": want_counts[0] - hits,
                      "bytes_out": hit_bytes}  # fmt: skip
            if changed != expect:
                raise AssertionError(f"counters moved by {changed}, Python's by {expect}")
            if fdp.ConsumeBool():  # sometimes at once, sometimes at the end
                hot.release(views, entries)
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
    # The C core (kvoffload/core): the daemon's hot path and the index it reads.
    "hot-gets": Target(fuzz_hot_gets, _core_seeds, CORE, 0.25),
    "dram-index": Target(fuzz_dram_index, _core_seeds, CORE, 0.1),
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
