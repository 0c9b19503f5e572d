from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from kvoffload.errors import CapacityError, InvalidArgumentError, KVOffloadError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make(capacity: int = 1 << 20, max_value: int = 64 << 10, policy: str = "lru") -> Engine:
    return Engine(
        EngineConfig(
            DramConfig(
                capacity_bytes=capacity, max_value_bytes=max_value, policy=policy, prefault=False
            )
        )
    )


@pytest.fixture
def engine() -> Engine:
    with make() as e:
        yield e


def test_put_get_round_trip_any_buffer(engine: Engine) -> None:
    engine.put(key(1), b"bytes")
    engine.put(key(2), bytearray(b"bytearray"))
    engine.put(key(3), np.arange(10, dtype=np.float32))
    engine.put(key(4), memoryview(np.arange(6, dtype=np.int16).reshape(2, 3)))
    with engine.get(key(1)) as view:
        assert bytes(view.data) == b"bytes"
        assert view.data.readonly
    out = np.zeros(10, dtype=np.float32)
    assert engine.get_into(key(3), out) == 40
    assert (out == np.arange(10)).all()
    buf = bytearray(12)
    assert engine.get_into(key(4), buf) == 12
    assert np.frombuffer(buf, np.int16).tolist() == list(range(6))


def test_torch_tensors_in_and_out(engine: Engine) -> None:
    torch = pytest.importorskip("torch")
    src = torch.randn(4, 8, dtype=torch.bfloat16)
    engine.put(key(1), src)
    dst = torch.empty(4, 8, dtype=torch.bfloat16)
    assert engine.get_into(key(1), dst) == 64
    assert torch.equal(src, dst)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        engine.put(key(2), src.t())


def test_miss_is_none_not_an_error(engine: Engine) -> None:
    assert engine.get(key(9)) is None
    assert engine.get_into(key(9), bytearray(4)) is None
    assert engine.contains(key(9)) is False
    assert engine.delete(key(9)) is False
    assert engine.size_of(key(9)) is None
    stats = engine.stats()
    assert stats.misses == 2 and stats.hits == 0


@pytest.mark.parametrize("bad", [b"short", b"x" * 17, "a" * 16, 16, None])
def test_bad_keys_are_refused_and_change_nothing(engine: Engine, bad: object) -> None:
    engine.put(key(1), b"keep")
    with pytest.raises(InvalidArgumentError, match="16 bytes"):
        engine.put(bad, b"v")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        engine.get(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        engine.put(key(2), b"v", parent=bad if bad is not None else b"")  # type: ignore[arg-type]
    assert engine.stats().tiers[0].entries == 1
    assert engine.lookup([key(1)]) == 1


def test_oversized_value_and_small_buffer_are_clear_errors(engine: Engine) -> None:
    with pytest.raises(InvalidArgumentError, match="exceeds the largest slot"):
        engine.put(key(1), bytes(engine.max_value_bytes + 1))
    engine.put(key(1), bytes(100))
    with pytest.raises(InvalidArgumentError, match="too small"):
        engine.get_into(key(1), bytearray(99))
    with pytest.raises(InvalidArgumentError, match="read-only"):
        engine.get_into(key(1), b"x" * 100)
    # The failed get_into left no pin behind: the block can still be evicted/deleted normally.
    assert engine.stats().tiers[0].pinned == 0


def test_lookup_counts_leading_hits(engine: Engine) -> None:
    for i in (0, 1, 2, 4):
        engine.put(key(i), b"v")
    assert engine.lookup([key(i) for i in range(6)]) == 3
    assert engine.lookup([]) == 0
    assert engine.lookup([key(7), key(0)]) == 0
    assert engine.prefetch([key(0), key(7)]) == 1


def test_view_survives_overwrite_and_delete(engine: Engine) -> None:
    engine.put(key(1), b"old value")
    view = engine.get(key(1))
    assert view is not None
    engine.put(key(1), b"new value")
    assert bytes(view.data) == b"old value"
    engine.delete(key(1))
    assert bytes(view.data) == b"old value"
    assert engine.get(key(1)) is None
    used = engine.stats().tiers[0].used_bytes
    view.release()
    assert engine.stats().tiers[0].used_bytes < used


def test_capacity_is_a_hard_bound_and_evicts(engine: Engine) -> None:
    value = os.urandom(60_000)
    for i in range(100):
        engine.put(key(i), value)
    tier = engine.stats().tiers[0]
    assert tier.used_bytes <= tier.capacity_bytes
    assert 0 < tier.entries < 100
    assert tier.evictions == 100 - tier.entries
    # LRU: the newest blocks are the ones kept.
    assert engine.contains(key(99)) and not engine.contains(key(0))


def test_pinned_blocks_are_never_evicted_and_full_pins_raise() -> None:
    with make(capacity=256 << 10) as engine:
        value = os.urandom(60_000)
        engine.put(key(0), value)
        views = [engine.get(key(0))]
        for i in range(1, 50):
            try:
                engine.put(key(i), value)
            except CapacityError:
                break
            views.append(engine.get(key(i)))
        else:
            pytest.fail("pinning everything must eventually refuse a put")
        assert all(v is not None and bytes(v.data) == value for v in views)
        assert all(engine.contains(key(j)) for j in range(len(views)))
        for v in views:
            assert v is not None
            v.release()
        engine.put(key(100), value)  # room again once released
        assert engine.contains(key(100))


def test_small_blocks_make_room_for_large_ones() -> None:
    # 1 MiB of 4 KiB blocks, then 60 KB blocks: each large put evicts the coldest small block
    # and the small ones beside it until the hole fits, never failing with nothing pinned.
    with make(capacity=1 << 20) as engine:
        for i in range(256):
            engine.put(key(i), bytes(4000))
        for i in range(1000, 1014):
            engine.put(key(i), bytes(60_000))
        stats = engine.stats()
        assert stats.neighbour_evictions > 0
        assert all(engine.contains(key(i)) for i in range(1000, 1014))
        # The coldest small blocks went; the newest ones are still there.
        assert not engine.contains(key(0)) and engine.contains(key(255))


def test_mixed_sizes_fill_the_arena() -> None:
    # Random sizes between 4 KiB and 64 KiB (a 1:16 spread, as 64 KiB-2 MiB): once full, the
    # tier keeps holding nearly all of its capacity in live values.
    rng = np.random.default_rng(7)
    with make(capacity=4 << 20) as engine:
        for i in range(2000):
            engine.put(key(i), bytes(int(rng.integers(4 << 10, 64 << 10))))
            if i >= 500 and i % 100 == 0:
                dram = engine.stats().tiers[0]
                assert dram.stored_bytes >= 0.85 * dram.capacity_bytes


def test_put_fails_only_when_pinned_blocks_leave_no_room() -> None:
    # Pinned 4 KiB blocks every 64 KiB leave no 64 KiB hole: a 64 KiB put fails, a 32 KiB fits.
    with make(capacity=1 << 20) as engine:
        for i in range(256):
            engine.put(key(i), bytes(4000))
        views = [engine.get(key(i)) for i in range(0, 256, 16)]
        with pytest.raises(CapacityError):
            engine.put(key(1000), bytes(64 << 10))
        engine.put(key(1001), bytes(32 << 10))
        assert engine.contains(key(1001))
        for v in views:
            assert v is not None
            v.release()
        engine.put(key(1000), bytes(64 << 10))  # room again once released


def test_prefix_policy_evicts_tails_before_parents() -> None:
    with make(capacity=512 << 10, policy="prefix") as engine:
        value = bytes(60_000)
        # A chain of 4 blocks, then unrelated single blocks that cause pressure.
        chain = [key(100 + i) for i in range(4)]
        for i, k in enumerate(chain):
            engine.put(k, value, parent=chain[i - 1] if i else None)
        for i in range(4):
            engine.put(key(i), value)
        # 8 slots of 64 KiB: the next puts evict. Chain tails go before roots.
        engine.put(key(50), value)
        engine.put(key(51), value)
        assert engine.contains(chain[0])
        assert engine.lookup(chain) >= 1


def test_orphans_go_first_under_prefix_policy() -> None:
    with make(capacity=512 << 10, policy="prefix") as engine:
        value = bytes(60_000)
        for i in range(10, 16):  # older than the chain below
            engine.put(key(i), value)
        engine.put(key(1), value)
        engine.put(key(2), value, parent=key(1))
        engine.delete(key(1))  # key(2) can no longer be reached by a prefix lookup
        engine.put(key(20), value)
        engine.put(key(21), value)
        # LRU would have evicted key(10); the orphan goes first although it is the newest.
        assert not engine.contains(key(2))
        assert all(engine.contains(key(i)) for i in range(10, 16))


def test_threads_put_and_read_consistently() -> None:
    with make(capacity=4 << 20) as engine:
        errors: list[BaseException] = []

        def worker(tid: int) -> None:
            try:
                buf = bytearray(50_000)
                for i in range(200):
                    k = key(tid * 1000 + i % 20)
                    payload = bytes([tid, i % 251]) * 20_000
                    engine.put(k, payload)
                    n = engine.get_into(k, buf)
                    if n is not None:
                        # Only this thread writes k, so any hit is its last value.
                        assert bytes(buf[:n]) == payload
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        tier = engine.stats().tiers[0]
        assert tier.used_bytes <= tier.capacity_bytes and tier.pinned == 0


def test_closed_engine_refuses_work() -> None:
    engine = make()
    engine.put(key(1), b"x")
    view = engine.get(key(1))
    engine.close()
    engine.close()
    assert view is not None
    view.release()  # a view outliving close is released safely
    with pytest.raises(KVOffloadError, match="closed"):
        engine.put(key(2), b"x")
    with pytest.raises(KVOffloadError, match="closed"):
        engine.lookup([key(1)])


def test_stats_count_bytes_and_operations(engine: Engine) -> None:
    engine.put(key(1), bytes(1000))
    engine.get_into(key(1), bytearray(1000))
    engine.delete(key(1))
    stats = engine.stats()
    tier = stats.tiers[0]
    assert (stats.puts, stats.hits, stats.deletes) == (1, 1, 1)
    assert tier.bytes_written == 1000 and tier.bytes_read == 1000
    assert stats.as_dict()["tiers"][0]["name"] == "dram"  # type: ignore[index]


def test_tenant_quota_evicts_only_that_tenants_blocks(engine: Engine) -> None:
    value = bytes(8000)  # an 8 KiB slot
    engine.set_quota("a", 3 * 8192)
    for i in range(5):
        engine.put(key(100 + i), value, tenant="b")
    for i in range(6):
        engine.put(key(i), value, tenant="a")
    stats = engine.stats()
    assert stats.tenant_bytes["a"] <= 3 * 8192
    assert stats.tenant_bytes["b"] == 5 * 8192
    assert [engine.contains(key(i)) for i in range(6)] == [False] * 3 + [True] * 3
    assert all(engine.contains(key(100 + i)) for i in range(5))
    # Overwriting a key of the tenant does not evict on account of the value it replaces.
    engine.put(key(5), value, tenant="a")
    assert engine.lookup([key(3), key(4), key(5)]) == 3


def test_tenant_quota_limits(engine: Engine) -> None:
    engine.set_quota("a", 4096)  # one small slot
    with pytest.raises(CapacityError, match="quota"):
        engine.put(key(1), bytes(5000), tenant="a")
    engine.put(key(1), bytes(100), tenant="a")
    with engine.get(key(1)), pytest.raises(CapacityError, match="pinned"):
        engine.put(key(2), bytes(100), tenant="a")
    engine.put(key(2), bytes(100), tenant="a")
    assert not engine.contains(key(1)) and engine.contains(key(2))
    engine.set_quota("a", None)
    engine.put(key(3), bytes(100), tenant="a")
    assert engine.stats().tenant_bytes["a"] == 2 * 4096
    with pytest.raises(InvalidArgumentError):
        engine.set_quota("a", -1)


def test_durable_put_without_ssd_is_refused(engine: Engine) -> None:
    with pytest.raises(InvalidArgumentError, match="SSD tier"):
        engine.put(key(1), b"v", durable=True)
    assert not engine.contains(key(1))


def test_reservation_fills_in_place_and_publishes_on_commit(engine: Engine) -> None:
    engine.put(key(1), b"old")
    with engine.reserve(key(1), 5, parent=key(0)) as res:
        res.buffer[:] = b"hello"
        assert engine.get_into(key(1), bytearray(8)) == 3  # still the old value
        res.commit()
    with engine.get(key(1)) as view:
        assert bytes(view.data) == b"hello"
    with pytest.raises(KVOffloadError, match="already"):
        res.commit()


def test_reservation_left_uncommitted_changes_nothing(engine: Engine) -> None:
    engine.put(key(1), b"old")
    before = engine.stats().tiers[0].used_bytes
    with pytest.raises(RuntimeError), engine.reserve(key(1), 10_000) as res:
        res.array[:] = 7
        raise RuntimeError("connection dropped mid-payload")
    assert engine.stats().tiers[0].used_bytes == before
    with engine.get(key(1)) as view:
        assert bytes(view.data) == b"old"
    res.abort()  # idempotent
    with pytest.raises(InvalidArgumentError, match="negative"):
        engine.reserve(key(2), -1)


def test_tier_listener_hears_puts_and_evictions_in_order() -> None:
    heard: list[tuple[str, bytes, str]] = []
    config = EngineConfig(
        DramConfig(capacity_bytes=4 << 20, max_value_bytes=1 << 20, prefault=False)
    )
    with Engine(config) as engine:
        engine.set_tier_listener(lambda kind, key, tier: heard.append((kind, key, tier)))
        keys = [i.to_bytes(16, "little") for i in range(8)]
        for key in keys:
            engine.put(key, bytes(1 << 20))
        stored = [k for kind, k, tier in heard if kind == "stored" and tier == "dram"]
        assert stored == keys  # every put, in order
        removed = [k for kind, k, tier in heard if kind == "removed"]
        assert removed and len(removed) == engine.stats().evictions
        for key in removed:  # each eviction comes after the put that stored the block
            assert heard.index(("stored", key, "dram")) < heard.index(("removed", key, "dram"))
        heard.clear()
        engine.delete(keys[-1])  # a delete is the caller's own doing: not reported
        assert heard == []
        engine.put(keys[-2], bytes(10))  # a replacement is a put
        assert heard == [("stored", keys[-2], "dram")]


def test_a_conditional_commit_checks_with_the_publish(engine: Engine) -> None:
    used = engine.stats().tiers[0].used_bytes
    absent = engine.reserve(key(7), 3)
    absent.buffer[:] = b"new"
    engine.put(key(7), b"old")  # stored after the reservation, before its commit
    assert absent.commit(if_stored=False) is False
    assert _value(engine, key(7)) == b"old"  # the conditional value was not published ...
    engine.delete(key(7))
    assert engine.stats().tiers[0].used_bytes == used  # ... and its slot was given back
    present = engine.reserve(key(7), 3)
    present.buffer[:] = b"new"
    assert present.commit(if_stored=True) is False
    assert not engine.contains(key(7))
    again = engine.reserve(key(7), 3)
    again.buffer[:] = b"new"
    assert again.commit(if_stored=False) is True
    assert _value(engine, key(7)) == b"new"


def _value(engine: Engine, k: bytes) -> bytes | None:
    view = engine.get(k)
    if view is None:
        return None
    with view:
        return bytes(view.data)


def test_a_dram_tier_that_cannot_be_mapped_is_a_config_error() -> None:
    import resource

    # Room for what the process maps now plus 1 GiB: a 64 GiB arena cannot be mapped.
    status = Path("/proc/self/status").read_text()
    mapped = int(status.split("VmSize:")[1].split()[0]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), hard))
    try:
        with pytest.raises(KVOffloadError, match="cannot map a DRAM arena"):
            make(capacity=64 << 30)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
