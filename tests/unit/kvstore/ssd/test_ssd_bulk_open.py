"""The bulk open and listing of a store (a restart of millions of blocks): keys whose hashes
collide, the metadata and tenants the listing reports, and a listing that leaves the engine's
lock free while it works."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.kvstore.described import DRAM, SSD, Listing
from kvoffload.kvstore.ssd.keyhash import hash_key

BLOCK = 4096
_C = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def config(path: Path) -> EngineConfig:
    return EngineConfig(
        DramConfig(capacity_bytes=1 << 20, max_value_bytes=16 << 10, prefault=False),
        SsdConfig(capacity_bytes=32 << 20, admission_min_uses=1, flush_on_close=True),
        data_dir=str(path),
    )


def colliding(lo: int, hi: int, other_hi: int) -> tuple[bytes, bytes]:
    """Two distinct keys with the same 64-bit index hash (`hash_key` mixes lo ^ hi * C)."""
    other_lo = lo ^ ((hi * _C) & _MASK) ^ ((other_hi * _C) & _MASK)
    a = lo.to_bytes(8, "little") + hi.to_bytes(8, "little")
    b = other_lo.to_bytes(8, "little") + other_hi.to_bytes(8, "little")
    assert a != b and hash_key(a) == hash_key(b)
    return a, b


@pytest.mark.parametrize("checkpoint", [False, True])
def test_keys_sharing_a_hash_both_come_back_with_their_newest_values(
    tmp_path: Path, checkpoint: bool
) -> None:
    a, b = colliding(5, 7, 11)
    c, d = colliding(1 << 40, 3, 9)
    with Engine(config(tmp_path)) as engine:
        for i, k in enumerate((a, b, c, d)):
            engine.put(k, bytes([i]) * BLOCK, durable=True, meta=b"old-%d" % i)
        engine.put(b, b"\xee" * BLOCK, durable=True, meta=b"new")  # b's newest version
        if checkpoint:
            engine.checkpoint()
    with Engine(config(tmp_path)) as engine:
        assert engine.recovery is not None and engine.recovery.blocks == 4
        for i, k in enumerate((a, b, c, d)):
            view = engine.get(k)
            assert view is not None
            with view:
                assert bytes(view.data) == (b"\xee" if k == b else bytes([i])) * BLOCK
        assert {x.key: x.meta for x in engine.described_blocks()} == {
            a: b"old-0",
            b: b"new",
            c: b"old-2",
            d: b"old-3",
        }


def test_the_listing_names_tenants_tiers_and_metadata_of_both_tiers(tmp_path: Path) -> None:
    keys = [i.to_bytes(16, "little") for i in range(1, 9)]
    with Engine(config(tmp_path)) as engine:
        for i, k in enumerate(keys):
            big = b"m" * 200 if i % 3 == 0 else b"%d" % i  # several META records, or one
            engine.put(k, bytes(BLOCK), durable=i < 6, tenant=("", "t1", "t2")[i % 3], meta=big)
        table = engine.described_table()
        assert len(table) == len(keys)
        got = {b.key: b for b in table.blocks()}
        for i, k in enumerate(keys):
            block = got[k]
            assert block.tenant == ("", "t1", "t2")[i % 3]
            assert block.meta == (b"m" * 200 if i % 3 == 0 else b"%d" % i)
            # Durable puts are on both tiers (SSD first); the rest only in DRAM.
            assert block.tiers == (("ssd", "dram") if i < 6 else ("dram",))
        bits = dict(zip(table.keys, table.tiers.tolist(), strict=True))
        assert bits[keys[0]] == SSD | DRAM and bits[keys[7]] == DRAM


def test_a_get_is_served_while_the_listing_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [i.to_bytes(16, "little") for i in range(1, 201)]
    with Engine(config(tmp_path)) as engine:
        for k in keys:
            engine.put(k, k * (BLOCK // 16), durable=True, meta=b"x" * 40)
    inside, release = threading.Event(), threading.Event()
    original = Listing.table

    def paused(self: Listing) -> object:
        # Fault injection: hold the listing in its per-block part until the get is done.
        inside.set()
        release.wait(30)
        return original(self)

    monkeypatch.setattr(Listing, "table", paused)
    with Engine(config(tmp_path)) as engine:
        listed: list[int] = []
        lister = threading.Thread(target=lambda: listed.append(len(engine.described_table())))
        lister.start()
        assert inside.wait(30)
        served: list[bytes] = []

        def get() -> None:
            view = engine.get(keys[7])
            assert view is not None
            with view:
                served.append(bytes(view.data))

        getter = threading.Thread(target=get)
        getter.start()
        getter.join(30)  # a listing holding the lock would keep it waiting
        done = not getter.is_alive()
        release.set()
        lister.join(30)
        getter.join(30)
        assert done and served == [keys[7] * (BLOCK // 16)]
        assert listed == [len(keys)]


def test_changes_after_an_open_replace_what_it_installed(tmp_path: Path) -> None:
    keys = [i.to_bytes(16, "little") for i in range(1, 41)]
    with Engine(config(tmp_path)) as engine:
        for i, k in enumerate(keys):
            engine.put(k, bytes(BLOCK), durable=True, meta=b"v1-%d" % i + b"." * (i * 7))
    want = {k: b"v1-%d" % i + b"." * (i * 7) for i, k in enumerate(keys)}
    for round_ in range(2):  # the second open installs what the first one's changes left
        with Engine(config(tmp_path)) as engine:
            assert {b.key: b.meta for b in engine.described_blocks()} == want
            changed, gone, bare = keys[3 + round_], keys[10 + round_], keys[20 + round_]
            engine.put(changed, bytes(BLOCK), durable=True, meta=b"v2" * 60)
            engine.delete(gone)
            engine.put(bare, bytes(BLOCK), durable=True)  # a put without metadata drops it
            want[changed] = b"v2" * 60
            del want[gone], want[bare]
            assert engine.meta_of(changed) == b"v2" * 60
            assert engine.meta_of(gone) is None and engine.meta_of(bare) is None
            assert engine.meta_of(keys[30]) == want[keys[30]]  # installed, untouched
            assert {b.key: b.meta for b in engine.described_blocks()} == want
            if round_:
                engine.checkpoint()
