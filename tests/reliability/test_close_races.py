"""Calls racing a client's close(), or made after it, fail with a KVOffloadError (or answer as a
miss where the API says so), never with RuntimeError, ValueError or the like: a serving engine
catches one exception family. Bounded: a fixed number of rounds and of calls per thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload.client_sdk import Client
from kvoffload.errors import KVOffloadError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig

ROUNDS = 12
CALLS = 40  # per thread and round
THREADS = 3
BLOCK = 64 << 10
N = 64  # 4 MiB of blocks, a 1 MiB DRAM tier: batched gets read the SSD
WAIT_S = 60  # a hang guard, never a timing assertion


def _keys() -> list[bytes]:
    return [i.to_bytes(16, "big") for i in range(1, N + 1)]


def _work(client: Client, keys: list[bytes], which: int) -> Callable[[int], object]:
    buffers = [np.empty(BLOCK, dtype=np.uint8) for _ in keys]
    value = np.full(BLOCK, which, dtype=np.uint8)
    ops: list[Callable[[int], object]] = [
        lambda i: client.get_many_into(keys, buffers),
        lambda i: client.get_many(keys[i % 8 :: 4]),
        lambda i: client.get(keys[i % N]),
        lambda i: client.put(keys[i % N], value),
        lambda i: client.lookup(keys),
        lambda i: client.prefetch(keys[::3]),
    ]
    return lambda i: ops[(i + which) % len(ops)](i)


def _race(client: Client) -> list[BaseException]:
    """Threads calling the client while the main thread closes it; what they raised."""
    keys = _keys()
    errors: list[BaseException] = []
    started = threading.Barrier(THREADS + 1)

    def run(which: int) -> None:
        call = _work(client, keys, which)
        started.wait(WAIT_S)
        for i in range(CALLS):
            try:
                call(i)
            except BaseException as exc:  # noqa: BLE001 - what escapes is the finding
                errors.append(exc)
                if not isinstance(exc, KVOffloadError):
                    return

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    started.wait(WAIT_S)
    client.close()
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    return errors


def _after_close(client: Client) -> list[BaseException]:
    keys = _keys()
    errors: list[BaseException] = []
    call = _work(client, keys, 0)
    for i in range(6):
        try:
            call(i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    return errors


def _check(errors: list[BaseException]) -> None:
    strays = [e for e in errors if not isinstance(e, KVOffloadError)]
    assert not strays, [f"{type(e).__name__}: {e}" for e in strays]


def _fill(url: str) -> None:
    value = np.arange(BLOCK, dtype=np.uint8)
    with Client.connect(url) as client:
        client.put_many([(k, value) for k in _keys()])


def test_local_calls_racing_close_raise_kvoffload_errors(tmp_path: Path) -> None:
    url = f"local://{tmp_path}?dram=1MiB&ssd=16MiB&admit=1"
    _fill(url)
    for _ in range(ROUNDS):
        client = Client.connect(url)
        _check(_race(client))
        _check(_after_close(client))


@pytest.mark.integration
def test_kv_calls_racing_close_raise_kvoffload_errors(start_daemon: Any) -> None:
    daemon = start_daemon("--dram", "1MiB", "--ssd", "16MiB")
    _fill(daemon.url())
    for _ in range(ROUNDS):
        client = Client.connect(daemon.url())
        _check(_race(client))
        _check(_after_close(client))


def test_a_reservation_committed_after_close_fails() -> None:
    # A put that reserved before close() and commits after it was acknowledged before and lost
    # (the close's flush was over): it fails now.
    engine = Engine(EngineConfig(DramConfig(capacity_bytes=1 << 20, prefault=False)))
    reservation = engine.reserve(bytes(16), 100)
    engine.close()
    with pytest.raises(KVOffloadError, match="closed"):
        reservation.commit()
    with pytest.raises(KVOffloadError, match="closed"):
        engine.put(bytes(16), b"x")


def test_a_second_close_returns_once_the_first_has_flushed(tmp_path: Path) -> None:
    # The first close writes 60 DRAM-only blocks to the SSD; a close() racing it must not
    # return before that is done (a caller that reopens or exits right after would lose them).
    from kvoffload.kvstore import SsdConfig

    cfg = EngineConfig(
        DramConfig(capacity_bytes=64 << 20, max_value_bytes=1 << 20, prefault=False),
        SsdConfig(capacity_bytes=256 << 20, admission_min_uses=1, flush_on_close=True),
        data_dir=str(tmp_path),
    )
    engine = Engine(cfg)
    for i in range(60):
        engine.put(i.to_bytes(16, "little"), bytes([i]) * (1 << 20))
    first = threading.Thread(target=engine.close)
    first.start()
    for _ in range(1_000_000):  # until the first close has begun (bounded)
        if engine._m.closing:
            break
    engine.close()
    assert not first.is_alive()
    first.join()
    with Engine(cfg) as reopened:
        assert reopened.recovery.blocks == 60


@pytest.mark.parametrize("ssd", [False, True])
def test_a_close_right_after_a_slot_is_claimed_fails_the_put_with_kvoffload_error(
    tmp_path: Path, ssd: bool
) -> None:
    # close() lands between the claim (Manager.reserve, which drops the lock) and the
    # reservation's views: once an AttributeError from the unmapped arena, now the put's
    # KVOffloadError, and what was stored before is kept.
    from kvoffload.kvstore import SsdConfig

    cfg = EngineConfig(
        DramConfig(capacity_bytes=1 << 20, prefault=False),
        SsdConfig(capacity_bytes=16 << 20 if ssd else 0, admission_min_uses=1),
        data_dir=str(tmp_path) if ssd else "",
    )
    kept = (1).to_bytes(16, "big")
    for call in ("put", "reserve"):
        engine = Engine(cfg)
        engine.put(kept, b"kept" * 100)
        claim = engine._m.reserve

        def claim_then_close(*args: Any, engine: Engine = engine, claim: Any = claim) -> Any:
            claimed = claim(*args)
            engine.close()  # deterministic: exactly inside the window
            return claimed

        engine._m.reserve = claim_then_close  # type: ignore[method-assign]
        with pytest.raises(KVOffloadError, match="closed"):
            if call == "put":
                engine.put(bytes(16), b"x" * 5000)
            else:
                with engine.reserve(bytes(16), 5000) as reservation:
                    reservation.array[:] = 7  # still mapped: the views hold it
                    reservation.commit()
        if ssd:
            with Engine(cfg) as reopened:
                assert reopened.get(kept) is not None and reopened.get(bytes(16)) is None
