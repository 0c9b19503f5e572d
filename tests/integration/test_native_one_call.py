"""The sync `kv://` client's one-call exchanges (`_speedups_net.c`) against the Python codec,
the reference, through real daemons: the same sequence of puts and gets on both paths gives the
same answers (hits, misses, partial batches, buffers of other sizes, damaged and refused
blocks, tenants, sealed and forged blocks, errors) and leaves the same bytes in the caller's
buffers; and the C path is the one taken where it applies (never over TLS)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload.client_sdk import Client, Namespace, SealKeys
from kvoffload.client_sdk.transports import open_transport
from kvoffload.client_sdk.url import parse_url
from kvoffload.errors import KVOffloadError, TransportError
from kvoffload.wire import fast
from kvoffload.wire.block import HEADER_BYTES, seal
from kvoffload.wire.native.connection import Event, GetMany, GetManyResult, NativeConnection
from tests.conftest import Daemon
from tests.integration.test_client_bad_answers import Answer, peer
from tests.integration.test_daemon import _self_signed

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif("c" not in fast.available(), reason="the C extension is not built"),
]

Start = Callable[..., Daemon]
NS = Namespace("org/model", block_tokens=4, num_layers=2, num_kv_heads=2, head_size=8)
SIZES = [1, 95, 600, 4096, (64 << 10) + 1, (2 << 20) + 3]
ALICE, BOB = "alice-secret-0123456789", "bob-secret-9876543210"
K1, STRANGER = bytes([11]) * 32, bytes([13]) * 32


@contextmanager
def implementation(name: str) -> Iterator[dict[str, int]]:
    """Run the client's codec functions in C or Python; counts the one-call exchanges made."""
    calls = {"get_into": 0, "put": 0, "get_many_into": 0}
    previous = fast.use(name)
    real_get, real_put, real_many = fast.net_get_into, fast.net_put, fast.net_get_many_into

    def get_into(*args: Any) -> Any:
        calls["get_into"] += 1
        return real_get(*args)  # type: ignore[misc]

    def put(*args: Any) -> Any:
        calls["put"] += 1
        return real_put(*args)  # type: ignore[misc]

    def get_many_into(*args: Any) -> Any:
        calls["get_many_into"] += 1
        return real_many(*args)  # type: ignore[misc]

    if real_get is not None:
        fast.net_get_into, fast.net_put, fast.net_get_many_into = get_into, put, get_many_into
    try:
        yield calls
    finally:
        fast.use(previous)


def value(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def outcome(call: Callable[[], object]) -> object:
    try:
        return ("ok", call())
    except Exception as exc:  # the answer to compare, whatever it is
        return ("raised", type(exc).__name__, str(exc))


def _put_damaged(client: Client, key: bytes, data: bytes, at: int) -> None:
    """`data` under `key` with a header made for it, then byte `at` flipped."""
    sealed = client._requests.prepare_put(key, data, None, None)
    damaged = bytearray(data)
    damaged[at] ^= 0x01
    client._transport.put(sealed.key, (sealed.header, damaged), None)


def session(client: Client, tag: int) -> list[object]:
    """A sequence of operations; every answer and every buffer's bytes, in order."""
    seen: list[object] = []
    key = lambda i: bytes([tag, i]) * 8  # noqa: E731 - the run's own keys
    for i, size in enumerate(SIZES):
        data = value(size, i)
        seen.append(outcome(lambda: client.put(key(i), data)))  # noqa: B023
        for room in (size, size + 100, max(size - 1, 0)):
            out = bytearray(b"\x55" * room)
            seen.append((size, room, outcome(lambda: client.get_into(key(i), out))))  # noqa: B023
            seen.append(bytes(out) == data[:room] or bytes(out).hex()[:64])
            seen.append(bytes(out[size:]) == b"\x55" * max(room - size, 0))
        out = bytearray(b"\x55" * size)
        seen.append(outcome(lambda: client.get_into(key(200 + i), out)))  # noqa: B023 - a miss
        seen.append(bytes(out) == b"\x55" * size)
        if size > 1:
            for n, at in enumerate((0, size // 2, size - 1)):
                _put_damaged(client, key(100 + 3 * i + n), data, at)
                out = bytearray(b"\x55" * size)
                seen.append(outcome(lambda: client.get_into(key(100 + 3 * i + n), out)))  # noqa: B023
                seen.append(bytes(out) == bytes(size))
    # A batch with hits, misses and a damaged block, into buffers.
    keys = [key(0), key(250), key(3), key(101), key(5)]
    buffers = [bytearray(b"\x55" * ((2 << 20) + 8)) for _ in keys]
    seen.append(outcome(lambda: client.get_many_into(keys, buffers)))
    seen.append([bytes(b[:64]).hex() for b in buffers])
    seen.append(outcome(lambda: client.put_many([(key(40), value(3000, 40))])))
    seen.append(outcome(lambda: client.get(key(40))))
    seen.append(outcome(lambda: client.put(key(41), value(200 << 20, 41))))  # over the limit
    stats = client.stats()
    seen.append((stats.hits, stats.misses, stats.corrupt_blocks, stats.puts))
    return seen


def test_both_paths_answer_alike_through_a_daemon(start_daemon: Start) -> None:
    daemon = start_daemon("--dram", "256MiB")
    answers = {}
    for tag, name in enumerate(("python", "c")):
        with implementation(name) as calls, Client.connect(daemon.url()) as client:
            answers[name] = session(client, tag)
        if name == "c":  # every get_into and put went through the one-call exchange
            assert calls["get_into"] >= 4 * len(SIZES) and calls["put"] >= len(SIZES)
            assert calls["get_many_into"] == 1
    assert answers["c"] == answers["python"]


def test_tenants_see_only_their_own_blocks_on_both_paths(start_daemon: Start) -> None:
    config = f'[cluster]\nnode_id = "n1"\n[tenants.alice]\ntoken = "{ALICE}"\n'
    config += f'[tenants.bob]\ntoken = "{BOB}"\n'
    daemon = start_daemon(config=config)
    answers = {}
    for name in ("python", "c"):
        seen: list[object] = []
        with (
            implementation(name) as calls,
            Client.connect(daemon.url(token=ALICE)) as alice,
            Client.connect(daemon.url(token=BOB)) as bob,
        ):
            data = value(70000, 1)
            alice.put(b"t" * 16, data)
            for client in (alice, bob):
                out = bytearray(len(data))
                seen.append(outcome(lambda: client.get_into(b"t" * 16, out)))  # noqa: B023
                seen.append(bytes(out) == data)
        answers[name] = seen
        if name == "c":
            assert calls["get_into"] == 2
    assert answers["c"] == answers["python"] == [("ok", 70000), True, ("ok", None), False]


def test_sealed_and_forged_blocks_alike_on_both_paths(start_daemon: Start) -> None:
    daemon = start_daemon()
    answers = {}
    for tag, name in enumerate(("python", "c")):
        genuine, forged = bytes([tag, 1]) * 8, bytes([tag, 2]) * 8
        payload = value(NS.block_bytes, tag)
        seen: list[object] = []
        with (
            implementation(name),
            Client.connect(daemon.url(), namespace=NS, seal=SealKeys([(1, K1)])) as client,
        ):
            client.put(genuine, payload)
            raw = open_transport(parse_url(daemon.url()))
            try:
                header = seal(
                    key_or_hash=forged,
                    payload=payload,
                    stored_length=len(payload),
                    raw_length=len(payload),
                    namespace=NS.fingerprint,
                    mac_key=(1, STRANGER),
                )
                raw.put(forged, (header, payload), None)
            finally:
                raw.close()
            for key in (genuine, forged):
                out = bytearray(len(payload))
                seen.append(outcome(lambda: client.get_into(key, out)))  # noqa: B023
                seen.append(bytes(out) == payload)
                seen.append(not any(out))
            seen.append(client.stats().corrupt_blocks)
        answers[name] = seen
    size = NS.block_bytes
    assert (
        answers["c"]
        == answers["python"]
        == [("ok", size), True, False, ("ok", None), False, True, 1]
    )


def test_a_stored_value_too_short_for_a_header_goes_to_python_alike(start_daemon: Start) -> None:
    # Not a block of ours (shorter than its header): the C exchange hands the answer back and
    # the Python reader counts a corrupt miss, as it does on its own.
    daemon = start_daemon()
    answers = {}
    for name in ("python", "c"):
        with implementation(name), Client.connect(daemon.url()) as client:
            client._transport.put(b"s" * 16, (os.urandom(40),), None)
            out = bytearray(b"\x55" * 64)
            got = outcome(lambda: client.get_into(b"s" * 16, out))  # noqa: B023
            answers[name] = (got, bytes(out) == b"\x55" * 64, client.stats().corrupt_blocks)
    assert answers["c"] == answers["python"] == (("ok", None), True, 1)


def test_put_many_alike_on_both_paths_and_one_call_per_frame(start_daemon: Start) -> None:
    daemon = start_daemon("--dram", "256MiB")
    answers = {}
    for tag, name in enumerate(("python", "c")):
        keys = [bytes([tag, 60 + i]) * 8 for i in range(6)]
        items = [(k, value(1000 * (i + 1) ** 3, i)) for i, k in enumerate(keys)]
        seen: list[object] = []
        with implementation(name) as calls, Client.connect(daemon.url()) as client:
            seen.append(outcome(lambda: client.put_many(items)))  # noqa: B023
            if name == "c":
                assert calls["put"] == 1  # the whole batch: one frame, one call
            # A batch over the daemon's per-frame budget goes out in several frames (Python).
            big = [(bytes([tag, 90 + i]) * 8, value(7 << 20, i)) for i in range(3)]
            seen.append(outcome(lambda: client.put_many(big)))  # noqa: B023
            for key, data in [*items, *big]:
                out = bytearray(len(data))
                seen.append((outcome(lambda: client.get_into(key, out)), bytes(out) == data))  # noqa: B023
        answers[name] = seen
    assert answers["c"] == answers["python"]
    sizes = [1000 * (i + 1) ** 3 for i in range(6)] + [7 << 20] * 3
    assert answers["c"][:2] == [("ok", None), ("ok", None)]
    assert answers["c"][2:] == [(("ok", n), True) for n in sizes]


def _two_blocks_then_half(close: bool) -> Answer:
    """Answer a GetMany of three keys: two whole blocks (0xAA), then half of a third."""

    def answer(conn: NativeConnection, event: Event) -> tuple[bytes, bool]:
        assert isinstance(event, GetMany) and len(event.keys) == 3
        length = HEADER_BYTES + BLOCK
        frame = b"".join(
            bytes(p)
            for p in conn.send_parts(
                GetManyResult(event.request_id, (length,) * 3), [b"\xaa" * length] * 3
            )
        )
        return frame[: len(frame) - BLOCK // 2], close

    return answer


BLOCK = 1 << 20


@pytest.mark.parametrize("close", [True, False], ids=["closed", "stalled"])
def test_a_get_many_into_that_fails_part_way_leaves_no_partial_block(close: bool) -> None:
    with implementation("c") as calls, peer(_two_blocks_then_half(close)) as port:
        url = f"kv://127.0.0.1:{port}?retries=0&timeout=2"
        buffers = [bytearray(b"\x55" * (2 * BLOCK)) for _ in range(3)]
        expected = TransportError if close else KVOffloadError
        with Client.connect(url) as client, pytest.raises(expected):
            client.get_many_into([os.urandom(16) for _ in range(3)], buffers)
        assert calls["get_many_into"] == 1
        for buffer in buffers:
            assert b"\xaa" not in buffer  # the whole blocks too: the batch failed
            assert buffer[-1] == 0x55  # and what no byte reached is left alone


def test_a_batch_the_daemon_answers_in_part_is_finished_alike(start_daemon: Start) -> None:
    # 40 blocks of 1 MiB on a 64 MiB tier: one answer may pin a quarter of it
    # (native.answer_pin_share), so the daemon answers a prefix and the client asks again.
    daemon = start_daemon("--dram", "64MiB")
    answers = {}
    for tag, name in enumerate(("python", "c")):
        keys = [bytes([tag, i]) * 8 for i in range(40)]
        with implementation(name) as calls, Client.connect(daemon.url()) as client:
            for i, key in enumerate(keys):
                client.put(key, bytes([i]) * (1 << 20))
            buffers = [bytearray(1 << 20) for _ in keys]
            got = outcome(lambda: client.get_many_into(keys, buffers))  # noqa: B023
            answers[name] = (
                got,
                [bytes(b) == bytes([i]) * (1 << 20) for i, b in enumerate(buffers)],
            )
            for key in keys:
                client.delete(key)
        if name == "c":
            assert calls["get_many_into"] == 1  # the first request; the rest the general way
    assert answers["c"] == answers["python"]
    assert answers["c"] == (("ok", [1 << 20] * 40), [True] * 40)


def test_tls_connections_stay_on_the_python_path(start_daemon: Start, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    daemon = start_daemon("--tls-cert", str(cert), "--tls-key", str(key))
    url = daemon.url(tls="1", ca=str(cert), server_name="localhost")
    data = value(70000, 3)
    with implementation("c") as calls, Client.connect(url) as client:
        client.put(b"t" * 16, data)
        client.put_many([(b"u" * 16, data)])
        out = bytearray(len(data))
        assert client.get_into(b"t" * 16, out) == len(data) and out == data
        outs = [bytearray(len(data)) for _ in range(2)]
        assert client.get_many_into([b"t" * 16, b"u" * 16], outs) == [len(data)] * 2
        assert outs == [data, data]
    assert calls == {"get_into": 0, "put": 0, "get_many_into": 0}
