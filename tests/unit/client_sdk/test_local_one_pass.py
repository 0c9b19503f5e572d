"""local://: a block read back from the SSD is summed once (issue 30). The engine checks the
whole value against its slot's CRC as it reads it; the SDK derives the payload's CRC from that
and the header's by CRC combination instead of a second pass, and still catches a header that
does not match its payload."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest

import kvoffload.client_sdk.request_layer as request_layer
from kvoffload.client_sdk import Client
from kvoffload.client_sdk.transports.local import LocalTransport
from kvoffload.wire.block import HEADER_BYTES, crc32c_suffix, seal

BLOCK = 256 << 10
URL = "local://{}?dram=4MiB&ssd=64MiB&admit=1"


def key(i: int) -> bytes:
    return (900 + i).to_bytes(16, "big")


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, BLOCK, dtype=np.uint8)


@pytest.mark.parametrize("length", [0, 1, 7, 96, 4096, 65_537, BLOCK, 2 << 20])
def test_the_suffix_crc_is_what_a_pass_over_it_gives(length: int) -> None:
    head, tail = os.urandom(HEADER_BYTES), os.urandom(length)
    whole = crc32c.crc32c(head + tail)
    assert crc32c_suffix(whole, crc32c.crc32c(head), length) == crc32c.crc32c(tail)
    assert crc32c_suffix(whole ^ 1, crc32c.crc32c(head), length) != crc32c.crc32c(tail)
    with pytest.raises(ValueError):
        crc32c_suffix(whole, 0, -1)


class Summed:
    """Bytes the SDK's CRC32C functions read (a spy: the real functions still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        fast = request_layer._fast
        for name in ("crc32c", "crc32c_copy"):
            monkeypatch.setattr(fast, name, self._wrap(getattr(fast, name), name))

    def _wrap(self, real: Callable[..., int], name: str) -> Callable[..., int]:
        def spy(*args: Any) -> int:
            self.bytes += len(memoryview(args[1 if name == "crc32c_copy" else 0]).cast("B"))
            return real(*args)

        return spy


def test_a_cold_block_is_summed_once_and_a_dram_one_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Client.connect(URL.format(tmp_path)) as client:
        client.put_many((key(i), value(i)) for i in range(30))  # ~7 MiB: the first on SSD
    with Client.connect(URL.format(tmp_path)) as client:  # DRAM empty: every block is cold
        summed = Summed(monkeypatch)
        buf = np.empty(BLOCK, dtype=np.uint8)
        assert client.get_into(key(0), buf) == BLOCK and np.array_equal(buf, value(0))
        assert summed.bytes == HEADER_BYTES  # the header's CRC only: no pass over the payload
        bufs = [np.empty(BLOCK, dtype=np.uint8) for _ in range(4)]
        assert client.get_many_into([key(i) for i in range(1, 5)], bufs) == [BLOCK] * 4
        assert all(np.array_equal(b, value(i + 1)) for i, b in enumerate(bufs))
        assert client.get(key(5)) == value(5).tobytes()
        assert summed.bytes == 6 * HEADER_BYTES
        client.put(key(99), value(99))  # in DRAM only: never checked by the engine
        summed.bytes = 0
        assert client.get_into(key(99), buf) == BLOCK and np.array_equal(buf, value(99))
        assert summed.bytes >= BLOCK
        assert client.stats().corrupt_blocks == 0


def test_a_header_that_does_not_match_its_payload_is_still_a_corrupt_miss(
    tmp_path: Path,
) -> None:
    with Client.connect(URL.format(tmp_path)) as client:
        client.put(key(0), value(0))
        transport = client.transport
        assert isinstance(transport, LocalTransport)
        payload = value(1).tobytes()
        header = seal(key_or_hash=key(1), payload=payload, stored_length=BLOCK,
                      raw_length=BLOCK)  # fmt: skip
        lying = bytearray(header + payload)
        lying[-1] ^= 0xFF  # the payload no longer matches the CRC its header declares
        # Stored as opaque bytes: the engine's own slot CRC is over these very bytes.
        transport.engine.put(key(1), bytes(lying))
        client.put_many((key(i), value(i)) for i in range(2, 30))
    with Client.connect(URL.format(tmp_path)) as client:
        buf = np.full(BLOCK, 7, dtype=np.uint8)
        assert client.get_into(key(1), buf) is None
        assert (buf == 7).all()  # no byte of it reached the caller's buffer
        assert client.get(key(1)) is None
        assert client.stats().corrupt_blocks == 2
        assert client.get_into(key(0), buf) == BLOCK and np.array_equal(buf, value(0))
