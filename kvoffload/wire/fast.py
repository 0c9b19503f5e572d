"""The data plane's C fast path (`_speedups`, built by setup.py) or its pure-Python twin.

Everything here has both forms; the Python one defines what is right and the tests run both.
`KVOFFLOAD_PURE_PYTHON=1` forces Python; `KVOFFLOAD_REQUIRE_EXT=1` makes a missing extension
an ImportError (CI sets it to prove the extension built). `use()` switches at run time (tests).

- `crc32c(data, crc=0)`: the `crc32c` package's checksum.
- `crc32c_copy(dst, src, crc=0)`: copy `src` to the start of `dst` and return its CRC32C,
  reading it once (a verified get into a caller's buffer).
- `all_keys(seq, size)`: whether `seq` is a list or tuple of `bytes` (exactly, no subclass)
  of `size` bytes each: the client's check of a key list, one pass in C.
- `parse_frame(buf, start, end, max_header, max_payload)`: the event of a whole, canonical Get,
  Exists, Put, GetResult, PutDone or ExistsResult frame at `buf[start:end]` with the offset
  after its map and its head tuple; None for anything else (the Python codec then parses it
  and raises its usual errors). The Python form is always None: the general path.
- `frame_head(op, request_id, name, value, payload_length)`: an answer's frame header and its
  map of one entry (`name` None: empty), as `frames.encode_frame` builds them.
- `net_get_into`, `net_get_many_into`, `net_put`, `net_lookup`: the sync `kv://` client's
  get_into, get_many_into (up to `NET_MAX_KEYS` keys), put and put_many (one frame) and
  lookup (up to `NET_LOOKUP_MAX_KEYS` keys, its frame built in C) as one call each
  (send, receive, sum the payload as it lands; `_speedups_net.c`). C only: None under Python,
  whose codec is the reference the client then runs (the C calls hand it anything unexpected).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import fields
from types import ModuleType

import crc32c as _crc32c
import msgpack

from kvoffload.errors import KVOffloadError
from kvoffload.wire.native.frames import FLAG_RESPONSE, FRAME, MAGIC, VERSION, ParseFrame

__all__ = [
    "IMPLEMENTATION",
    "KINDS",
    "all_keys",
    "available",
    "crc32c",
    "crc32c_copy",
    "frame_head",
    "net_get_into",
    "net_get_many_into",
    "net_lookup",
    "net_put",
    "parse_frame",
    "use",
]

# The event classes parse_frame builds and their fields, in _speedups_frames.c's order
# (native.py registers them). A class whose fields differ (a newer protocol) stays with Python.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Get", ("request_id", "key")),
    ("Exists", ("request_id", "key")),
    ("Put", ("request_id", "key", "length", "parent", "durable", "block_meta")),
    ("GetResult", ("request_id", "length")),
    ("PutDone", ("request_id",)),
    ("ExistsResult", ("request_id", "found")),
)


class ExtensionMissingError(KVOffloadError, ImportError):
    """KVOFFLOAD_REQUIRE_EXT is set and the C extension did not build or load."""


def _load() -> ModuleType | None:
    if os.environ.get("KVOFFLOAD_PURE_PYTHON") == "1":
        return None
    try:
        from kvoffload.wire import _speedups

        stale(_speedups, _NAMES)
    except ImportError as exc:
        if os.environ.get("KVOFFLOAD_REQUIRE_EXT") == "1":
            raise ExtensionMissingError(f"the C extension is required and missing: {exc}") from exc
        if exc.name is None:  # there but stale: say so (a build that is absent is no news)
            warnings.warn(f"kvoffload runs its pure-Python path: {exc}", stacklevel=2)
        return None
    return _speedups


def stale(module: ModuleType, names: Sequence[str]) -> None:
    """Refuse a build older than its Python side (an editable install keeps the .so it built
    before a `git pull`): a clear ImportError, not an AttributeError at first use."""
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise ImportError(
            f"{module.__file__} is older than its Python code (it lacks {', '.join(missing)}): "
            "rebuild it with `pip install -e .` or `python setup.py build_ext --inplace`"
        )


# What `use("c")` and `register` take from the extension.
_NAMES = (
    "crc32c",
    "crc32c_copy",
    "frame_head",
    "parse_frame",
    "net_get_into",
    "net_put",
    "net_get_many_into",
    "net_lookup",
    "register",
    "all_keys",
)
_EXT = _load()

# A one-call exchange's answer: (status, length, crc, eof, bytes); see _speedups_net.c.
NetAnswer = tuple[int, int, int, int, bytes]
NetMany = tuple[int, "list[int] | None", "list[int] | None", int, bytes]


def py_crc32c(data: object, crc: int = 0) -> int:
    return int(_crc32c.crc32c(data, crc))  # type: ignore[arg-type]


def py_crc32c_copy(dst: object, src: object, crc: int = 0) -> int:
    source = memoryview(src).cast("B")  # type: ignore[arg-type]
    target = memoryview(dst).cast("B")  # type: ignore[arg-type]
    if len(target) < len(source):
        raise ValueError(f"destination of {len(target)} bytes for {len(source)} bytes")
    target[: len(source)] = source
    return int(_crc32c.crc32c(source, crc))


# Packed one-entry maps by (name, type, value): stores hold few distinct block sizes, so an
# answer's map is mostly a lookup. Bounded: the values are whatever the clients stored.
_MAPS: dict[tuple[str | None, type, object], bytes] = {}
_MAX_MAPS = 4096


def py_frame_head(
    op: int, request_id: int, name: str | None, value: object, payload_length: int
) -> bytes:
    cached = (name, type(value), value)
    packed = _MAPS.get(cached)
    if packed is None:
        packed = msgpack.packb({name: value} if name is not None else {}, use_bin_type=True)
        if len(_MAPS) < _MAX_MAPS:
            _MAPS[cached] = packed
    return (
        FRAME.pack(MAGIC, VERSION, op, FLAG_RESPONSE, request_id, len(packed), payload_length)
        + packed
    )


def py_all_keys(seq: object, size: int) -> bool:
    if not isinstance(seq, (list, tuple)) or type(seq) not in (list, tuple):  # exactly, as C
        return False
    # two passes that run in C, no Python step per key
    return set(map(type, seq)) <= {bytes} and set(map(len, seq)) <= {size}


all_keys: Callable[[object, int], bool] = py_all_keys
crc32c: Callable[..., int] = py_crc32c
crc32c_copy: Callable[..., int] = py_crc32c_copy
frame_head: Callable[[int, int, str | None, object, int], bytes] = py_frame_head
parse_frame: ParseFrame | None = None
# (fd, frame, request_id, header, buffer, timeout) -> (status, length, crc, eof, bytes read)
net_get_into: Callable[[int, object, int, object, object, float], NetAnswer] | None = None
# (fd, parts, request_id, answer op, timeout) -> the same tuple (a Put's or a PutMany's)
net_put: Callable[[int, Sequence[object], int, int, float], NetAnswer] | None = None
NET_MAX_PARTS = 1024
# (fd, frame, request_id, headers, buffers, timeout) -> (status, lengths, crcs, eof, bytes)
net_get_many_into: Callable[[int, object, int, list[object], list[object], float], NetMany] | None
net_get_many_into = None
NET_MAX_KEYS = 256
# (fd, keys, request_id, timeout) -> (status, count, eof, bytes read): a Lookup of 1 to
# NET_LOOKUP_MAX_KEYS keys framed in C, one sendmsg, its {"count": n} answer read in C
net_lookup: Callable[[int, object, int, float], tuple[int, int, int, bytes]] | None = None
NET_LOOKUP_MAX_KEYS = 4096
NET_DONE, NET_FALLBACK, NET_CUT = 0, 1, 2
IMPLEMENTATION = "python"


def available() -> tuple[str, ...]:
    """The implementations this process can use."""
    return ("python", "c") if _EXT is not None else ("python",)


def use(name: str) -> str:
    """Switch every function here to `name` ("c" or "python"); returns the previous one."""
    global all_keys, crc32c, crc32c_copy, frame_head, parse_frame, IMPLEMENTATION
    global net_get_into, net_get_many_into, net_put, net_lookup
    if name not in available():
        raise ValueError(f"implementation {name!r} is not available here ({available()})")
    previous = IMPLEMENTATION
    if name == "c":
        assert _EXT is not None
        crc32c, crc32c_copy, all_keys = _EXT.crc32c, _EXT.crc32c_copy, _EXT.all_keys
        frame_head, parse_frame = _EXT.frame_head, _EXT.parse_frame
        net_get_into, net_put = _EXT.net_get_into, _EXT.net_put
        net_get_many_into, net_lookup = _EXT.net_get_many_into, _EXT.net_lookup
    else:
        net_get_into = net_get_many_into = net_put = net_lookup = None
        all_keys = py_all_keys
        crc32c, crc32c_copy, frame_head, parse_frame = (
            py_crc32c,
            py_crc32c_copy,
            py_frame_head,
            None,
        )
    IMPLEMENTATION = name
    return previous


def register(classes: dict[str, type]) -> None:
    """Tell the extension which classes its events are (by name, `KINDS`)."""
    if _EXT is None:
        return
    for i, (name, names) in enumerate(KINDS):
        cls = classes[name]
        if tuple(f.name for f in fields(cls)) == names:
            _EXT.register(i, cls, names)


if _EXT is not None:
    use("c")
