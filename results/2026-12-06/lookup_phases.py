"""CPU per phase of a 1,000-key lookup's client side, each phase alone in a loop (process
time, 3,000 runs): main's Python path vs this branch's C calls. The socket phases are
measured end to end by lookup_prof.py and strace -c (data-plane-profile.md)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

from kvoffload.client_sdk.request_layer import _ONLY_BYTES, _ONLY_KEY_LENGTH
from kvoffload.wire import fast
from kvoffload.wire.native.events import Lookup, LookupResult
from kvoffload.wire.native.frames import FLAG_RESPONSE, FRAME, _unpack_map, encode_frame

N = 3000
KEYS = [i.to_bytes(16, "big") for i in range(1000)]


def cpu_us(fn: Callable[[], object]) -> float:
    for _ in range(100):
        fn()
    t0 = time.process_time()
    for _ in range(N):
        fn()
    return (time.process_time() - t0) / N * 1e6


def main() -> None:
    event = Lookup(5, tuple(KEYS))
    answer = b"".join(bytes(p) for p in encode_frame(8, FLAG_RESPONSE, 5, {"count": 1000}))

    def decode() -> object:  # what next_event does for it, less the connection's state
        head = FRAME.unpack_from(answer)
        meta = _unpack_map(memoryview(answer)[24 : 24 + head[5]])
        return LookupResult(head[4], **meta)  # type: ignore[arg-type]

    rows = {
        "key check, Python (to_keys: two set(map) passes)": cpu_us(
            lambda: set(map(type, KEYS)) <= _ONLY_BYTES and set(map(len, KEYS)) <= _ONLY_KEY_LENGTH
        ),
        "key check, C (all_keys)": cpu_us(lambda: fast.all_keys(KEYS, 16)),
        "Lookup event (fields._keys check again + tuple)": cpu_us(lambda: Lookup(5, tuple(KEYS))),
        "encode (encode_frame: msgpack.packb of 1,000 bin keys)": cpu_us(
            lambda: encode_frame(8, 0, 5, event.meta())
        ),
        "decode answer (head, msgpack map, LookupResult)": cpu_us(decode),
    }
    out = {
        "us_per_op": rows,
        "runs": N,
        "loadavg": os.getloadavg(),
        "implementation": fast.IMPLEMENTATION,
    }
    print(json.dumps(out, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
