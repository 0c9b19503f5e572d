"""KVOffloadHiCacheStorage's v2 per-pool interface (hybrid models) with SGLang 0.5.23's own code.

The MAMBA pool is SGLang's real `MambaPoolHost` (its page-first state buffers, its
`get_page_buffer_meta`, `get_data_page` and `set_from_flat_data_page`), built on CPU from a
`MambaStateBufferInfo` as SGLang's pool assembler does. Its module is loaded without the
``pool_host`` package's ``__init__``, which imports SGLang's model configs (and through them
torchvision, whose PyPI build needs CUDA); nothing in it is replaced. The KV and SWA pools are
the MHA test pool of `test_sglang_backend.py` (SGLang's `MHATokenToKVPoolHost` imports that
same model stack). SGLang's hybrid cache controller cannot be imported here either (it needs
tvm_ffi and sglang-kernel), so the tests call the backend as its code does: one
`PoolTransfer` per pool as SGLang's Mamba and SWA components build them (a backup names the
node's last page hash for MAMBA and the window's hashes for SWA; a prefetch query carries
placeholder keys whose count is the window), KV through v1 first, the sidecars through v2.
SGLang's own reference backend, `HiCacheFile`, gets the same writes and the same planted gaps,
and its `batch_exists_v2` must agree with ours: the hit policies are SGLang's, not ours.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("sglang", "KVOFFLOAD_REQUIRE_SGLANG")

import sglang.srt.mem_cache as sglang_mem_cache  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    count_pool_hits,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from test_sglang_backend import PAGE, HostPool, _backend, _config, _indices, _tokens  # noqa: E402

from kvoffload.client_sdk import Client  # noqa: E402
from kvoffload.connectors.sglang import KVOffloadHiCacheStorage  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TRAIL = PoolHitPolicy.TRAILING_PAGES
MAMBA_LAYERS = 2
SLOTS = 4  # device state slots; the host pool holds twice as many, plus one


def _pool_host_module(name: str) -> Any:
    """A module of SGLang's ``pool_host`` package, without the package's ``__init__``."""
    package = "sglang.srt.mem_cache.pool_host"
    if package not in sys.modules:
        stub = types.ModuleType(package)
        stub.__path__ = [str(Path(sglang_mem_cache.__path__[0]) / "pool_host")]
        sys.modules[package] = stub
    return importlib.import_module(f"{package}.{name}")


def mamba_pool(
    conv_dtype: torch.dtype = torch.bfloat16, ssm: tuple[int, ...] = (3, 4), side: bool = False
) -> Any:
    """SGLang's host pool of Mamba states (page size 1: one slot per state)."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros((MAMBA_LAYERS, SLOTS, *ssm), dtype=torch.float32),
        conv=(torch.zeros((MAMBA_LAYERS, SLOTS, 5, 2), dtype=conv_dtype),),
        # Slot side states make SGLang refuse zero copy: the pool is stored as flat pages.
        extra_checkpoint_buffers=(torch.zeros((SLOTS, 6), dtype=torch.int32),) if side else (),
    )
    cls = _pool_host_module("mamba").MambaPoolHost
    return cls(info, 2.0, 0, device_capacity=SLOTS, pin_memory=False, layout="page_first")


def fill_state(pool: Any, slot: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pool.temporal_buffer[slot] = torch.randn(pool.temporal_buffer[slot].shape, generator=g)
    conv = pool.conv_buffer[0]
    conv[slot] = torch.randn(conv[slot].shape, generator=g).to(conv.dtype)
    for side in pool.slot_state_buffers:
        side[slot] = torch.randint(0, 1000, side[slot].shape, generator=g, dtype=side.dtype)
    return state(pool, slot)


def state(pool: Any, slot: int) -> bytes:
    return bytes(pool.get_data_page(slot).numpy())


def _one(slot: int) -> torch.Tensor:
    return torch.tensor([slot], dtype=torch.int64)


class Engine:
    """One engine's host pools, attached to a storage backend as SGLang attaches them."""

    def __init__(self, backend: Any, kv: HostPool, mamba: Any, swa: HostPool) -> None:
        self.backend, self.kv, self.mamba, self.swa = backend, kv, mamba, swa
        if hasattr(backend, "register_mem_pool_host"):
            backend.register_mem_pool_host(kv)
        backend.register_mem_host_pool_v2(kv, PoolName.KV)
        backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        backend.register_mem_host_pool_v2(swa, PoolName.SWA)
        backend.on_host_pools_registered()

    def backup(self, hashes: list[str], first: int, last: int, state_slot: int) -> None:
        """Write back one radix node (pages first..last): its Mamba state and its last two
        SWA pages through v2, then its KV pages (the hybrid controller's order)."""
        node = hashes[first : last + 1]
        info = HiCacheStorageExtraInfo(prefix_keys=hashes[:first] or None)
        swa_pages = node[-2:]
        swa_first = last + 1 - len(swa_pages)
        transfers = [
            PoolTransfer(PoolName.MAMBA, host_indices=_one(state_slot), keys=node[-1:],
                         hit_policy=TRAIL),
            PoolTransfer(PoolName.SWA, host_indices=_indices(swa_first, len(swa_pages)),
                         keys=swa_pages, hit_policy=TRAIL),
        ]  # fmt: skip
        results = self.backend.batch_set_v2(transfers, extra_info=info)
        assert count_pool_hits(results) == {"mamba": 1, "swa": len(swa_pages)}
        if isinstance(self.backend, HiCacheFile):  # the generic interface, as SGLang uses it
            pages = [self.kv.get_data_page((first + i) * PAGE) for i in range(len(node))]
            assert self.backend.batch_set(node, pages)
        else:
            assert all(self.backend.batch_set_v1(node, _indices(first, len(node)), info))

    def query(self, hashes: list[str], swa_window: int = 2) -> PoolTransferResult:
        """A prefetch's hit query: placeholder keys whose count is each pool's window."""
        transfers = [
            PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAIL),
            PoolTransfer(PoolName.SWA, keys=["__placeholder__"] * swa_window, hit_policy=TRAIL),
        ]
        return self.backend.batch_exists_v2(hashes, transfers, HiCacheStorageExtraInfo())


def _hashes(seed: int, pages: int) -> list[str]:
    return get_storage_hash_str(_tokens(seed, pages), None, page_size=PAGE)


def _stored(engine: Engine, hashes: list[str]) -> dict[int, bytes]:
    """Two radix nodes, pages 0-1 and 2-3, with Mamba states in host slots 1 and 2."""
    for page in range(4):
        engine.kv.fill(page * PAGE, seed=page)
        engine.swa.fill(page * PAGE, seed=100 + page)
    states = {1: fill_state(engine.mamba, 1, seed=7), 3: fill_state(engine.mamba, 2, seed=8)}
    engine.backup(hashes, 0, 1, state_slot=1)
    engine.backup(hashes, 2, 3, state_slot=2)
    return states


def _file_backend(tmp_path: Path) -> HiCacheFile:
    return HiCacheFile(_config("file://unused"), file_path=str(tmp_path / "hicache"))


def _pools(**mamba: Any) -> tuple[HostPool, Any, HostPool]:
    return HostPool("page_first"), mamba_pool(**mamba), HostPool("page_first")


def _part_keys(backend: Any, pool: str, key: str) -> list[bytes]:
    return backend._pools[pool].hashes([key])  # type: ignore[no-any-return]


def _as_tuple(result: PoolTransferResult) -> tuple[int, dict[str, int], list[int]]:
    hits = {str(getattr(k, "value", k)): v for k, v in result.extra_pool_hit_pages.items()}
    return result.kv_hit_pages, hits, sorted(result.restorable_prefix_pages or [])


def test_v2_round_trip_per_pool_and_sglang_hit_policies(start_daemon: Any, tmp_path: Path) -> None:
    daemon = start_daemon()
    hashes = _hashes(1, 4)
    ours = Engine(_backend(_config(daemon.url()), HostPool("page_first")), *_pools())
    states = _stored(ours, hashes)
    reference = Engine(_file_backend(tmp_path), ours.kv, ours.mamba, ours.swa)
    _stored(reference, hashes)

    # Both boundaries with a Mamba state restore; SGLang's own backend says the same.
    assert _as_tuple(ours.query(hashes)) == (4, {"kv": 4, "mamba": 4, "swa": 4}, [2, 4])
    assert _as_tuple(ours.query(hashes)) == _as_tuple(reference.query(hashes))
    assert _as_tuple(ours.query(hashes[:3])) == (2, {"kv": 3, "mamba": 2, "swa": 3}, [2])
    assert _as_tuple(ours.query(hashes[:3])) == _as_tuple(reference.query(hashes[:3]))

    # A fresh engine loads every pool bit-exact into other host slots.
    fresh = Engine(_backend(_config(daemon.url()), HostPool("page_first")), *_pools())
    assert all(fresh.backend.batch_get_v1(hashes, _indices(0, 4)))
    load = [
        PoolTransfer(PoolName.MAMBA, host_indices=_one(5), keys=hashes[3:], hit_policy=TRAIL),
        PoolTransfer(PoolName.SWA, host_indices=_indices(2, 2), keys=hashes[2:],
                     hit_policy=TRAIL),
    ]  # fmt: skip
    assert fresh.backend.batch_get_v2(load) == {"mamba": [True], "swa": [True, True]}
    assert state(fresh.mamba, 5) == states[3]
    for page in range(4):
        for c in (0, 1):
            assert torch.equal(fresh.kv.read(page * PAGE, c).view(torch.int16),
                               ours.kv.read(page * PAGE, c).view(torch.int16))  # fmt: skip
    for page in (2, 3):
        for c in (0, 1):
            assert torch.equal(fresh.swa.read(page * PAGE, c).view(torch.int16),
                               ours.swa.read(page * PAGE, c).view(torch.int16))  # fmt: skip
    # Each pool's parts are blocks of their own: the Mamba state is stored as SGLang's pool
    # reports it, temporal then conv, each under the pool's own namespace.
    assert ours.backend._pools["mamba"].part_sizes == [
        MAMBA_LAYERS * 3 * 4 * 4, MAMBA_LAYERS * 5 * 2 * 2,
    ]  # fmt: skip
    for backend in (ours.backend, fresh.backend):
        backend.close()


def test_each_planted_failure_ends_the_hit_where_sglang_says(
    start_daemon: Any, tmp_path: Path
) -> None:
    daemon = start_daemon()
    hashes = _hashes(2, 4)
    ours = Engine(_backend(_config(daemon.url()), HostPool("page_first")), *_pools())
    states = _stored(ours, hashes)
    files = _file_backend(tmp_path)
    reference = Engine(files, ours.kv, ours.mamba, ours.swa)
    _stored(reference, hashes)
    raw = Client.connect(daemon.url())

    # Missing MAMBA part (the conv part of the last node's state): only the first boundary.
    conv_part = _part_keys(ours.backend, "mamba", hashes[3])[1]
    assert raw.transport.delete(conv_part[:16])
    (tmp_path / "hicache" / f"{files._get_component_key(hashes[3], 'mamba')}.bin").unlink()
    assert _as_tuple(ours.query(hashes)) == (2, {"kv": 4, "mamba": 2, "swa": 4}, [2])
    assert _as_tuple(ours.query(hashes)) == _as_tuple(reference.query(hashes))
    # ...and the state is not read from its remaining part.
    assert ours.backend.batch_get_v2(
        [PoolTransfer(PoolName.MAMBA, host_indices=_one(6), keys=hashes[3:], hit_policy=TRAIL)]
    ) == {"mamba": [False]}
    ours.backup(hashes, 2, 3, state_slot=2)  # stored again
    reference.backup(hashes, 2, 3, state_slot=2)
    assert ours.query(hashes).kv_hit_pages == 4

    # Missing SWA page inside the window of the last boundary: that boundary is lost too.
    swa_part = _part_keys(ours.backend, "swa", hashes[2])[0]
    assert raw.transport.delete(swa_part[:16])
    (tmp_path / "hicache" / f"{files._get_component_key(hashes[2], 'swa')}.bin").unlink()
    assert _as_tuple(ours.query(hashes)) == (2, {"kv": 4, "mamba": 4, "swa": 2}, [2])
    assert _as_tuple(ours.query(hashes)) == _as_tuple(reference.query(hashes))
    # A one-page window does not need page 2.
    assert ours.query(hashes, swa_window=1).kv_hit_pages == 4
    assert _as_tuple(ours.query(hashes, 1)) == _as_tuple(reference.query(hashes, 1))
    ours.backup(hashes, 2, 3, state_slot=2)

    # A missing KV page ends every pool's hit before it.
    kv_part = ours.backend._zero_copy_hashes(hashes[1:2])[0]
    assert raw.transport.delete(kv_part[:16])
    assert _as_tuple(ours.query(hashes)) == (0, {"kv": 1}, [])

    # A damaged MAMBA part is a failed load, never state in host memory.
    ours.backup(hashes, 0, 1, state_slot=1)
    temporal = _part_keys(ours.backend, "mamba", hashes[3])[0]
    damage_stored_block(daemon.url(), temporal, -5)
    # Negative control: the damaged block's bytes (read without verification) differ from
    # the state, so a load that skipped the check would have restored a wrong state.
    held = raw.transport.get(temporal[:16])
    assert held is not None and states[3][: MAMBA_LAYERS * 48] not in bytes(held.data)
    held.release()
    ours.mamba.temporal_buffer[6] = 1.0
    results = ours.backend.batch_get_v2(
        [PoolTransfer(PoolName.MAMBA, host_indices=_one(6), keys=hashes[3:], hit_policy=TRAIL)]
    )
    assert count_pool_hits(results) == {"mamba": 0}  # SGLang then recomputes from page 2
    assert state(ours.mamba, 6) != states[3]
    # The state of the earlier boundary still loads.
    assert ours.backend.batch_get_v2(
        [PoolTransfer(PoolName.MAMBA, host_indices=_one(6), keys=hashes[1:2], hit_policy=TRAIL)]
    ) == {"mamba": [True]}
    assert state(ours.mamba, 6) == states[1]
    raw.close()
    ours.backend.close()


@pytest.mark.parametrize(
    "other", [{"conv_dtype": torch.float16}, {"ssm": (4, 3)}], ids=["dtype", "shape"]
)
def test_a_state_of_another_layout_is_never_a_hit(start_daemon: Any, other: Any) -> None:
    daemon = start_daemon()
    hashes = _hashes(3, 4)
    ours = Engine(_backend(_config(daemon.url()), HostPool("page_first")), *_pools())
    _stored(ours, hashes)
    # Same model, KV and SWA, but Mamba states of another dtype or shape (same byte size).
    kv, _, swa = _pools()
    other_engine = Engine(_backend(_config(daemon.url()), kv), kv, mamba_pool(**other), swa)
    assert _as_tuple(other_engine.query(hashes)) == (0, {"kv": 4}, [])
    assert other_engine.backend.batch_get_v2(
        [PoolTransfer(PoolName.MAMBA, host_indices=_one(5), keys=hashes[3:], hit_policy=TRAIL)]
    ) == {"mamba": [False]}
    # Negative control: the same layout hits.
    assert ours.query(hashes).kv_hit_pages == 4
    ours.backend.close()
    other_engine.backend.close()


def test_flat_states_other_policies_and_ranks() -> None:
    url = "local://"
    hashes = _hashes(4, 3)
    # A Mamba pool with slot side states cannot report page buffers (SGLang refuses zero copy
    # for it): its states are stored as SGLang's flat pages, side state included.
    kv, mamba, swa = _pools(side=True)
    engine = Engine(_backend(_config(url, codec="lz4"), kv), kv, mamba, swa)
    pages = engine.backend._pools["mamba"]
    assert not pages.zero_copy and pages.part_sizes == [mamba.size_per_token]
    assert pages.client.codec.name == "lz4" and engine.backend._client.codec.name == "lz4"
    expected = fill_state(mamba, 3, seed=9)
    set_mamba = [PoolTransfer(PoolName.MAMBA, host_indices=_one(3), keys=hashes[2:],
                              hit_policy=TRAIL)]  # fmt: skip
    assert engine.backend.batch_set_v2(set_mamba) == {"mamba": [True]}
    assert all(engine.backend.batch_set_v1(hashes, _indices(0, 3)))
    got = [PoolTransfer(PoolName.MAMBA, host_indices=_one(7), keys=hashes[2:], hit_policy=TRAIL)]
    assert engine.backend.batch_get_v2(got) == {"mamba": [True]}
    assert state(mamba, 7) == expected

    # ALL_PAGES (e.g. an indexer pool): every page of the prefix; a gap ends it there.
    indexer = HostPool("page_first")
    engine.backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    all_pages = PoolTransfer(PoolName.INDEXER, keys=hashes, host_indices=_indices(0, 3))
    assert engine.backend.batch_set_v2([all_pages]) == {"indexer": [True] * 3}
    query = [PoolTransfer(PoolName.INDEXER, keys=hashes)]
    assert _as_tuple(engine.backend.batch_exists_v2(hashes, query)) == (
        3, {"kv": 3, "indexer": 3}, [1, 2, 3],
    )  # fmt: skip
    engine.backend._pools["indexer"].client.delete(_part_keys(engine.backend, "indexer",
                                                              hashes[1])[0])  # fmt: skip
    assert _as_tuple(engine.backend.batch_exists_v2(hashes, query)) == (
        1, {"kv": 3, "indexer": 1}, [1],
    )  # fmt: skip
    # BLOCK_GROUPS pools never gate the KV hit (SGLang's definition); a pool never
    # registered ends the hit.
    groups = PoolTransfer(PoolName.DRAFT, keys=hashes, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    engine.backend.register_mem_host_pool_v2(HostPool("page_first"), PoolName.DRAFT)
    assert engine.backend.batch_exists_v2(hashes, [groups]).kv_hit_pages == 3
    unknown = PoolTransfer(PoolName.DRAFT_SWA, keys=["__placeholder__"], hit_policy=TRAIL)
    assert engine.backend.batch_exists_v2(hashes, [unknown]).kv_hit_pages == 0
    assert engine.backend.batch_get_v2([unknown]) == {"draft_swa": [False]}
    engine.backend.close()


@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1", "generic"])
def test_kv_pages_handed_to_v2_use_the_kv_keys(zero_copy: bool) -> None:
    kv = HostPool("page_first")
    backend = _backend(_config("local://", zero_copy=zero_copy), kv)
    hashes = _hashes(6, 2)
    for page in range(2):
        kv.fill(page * PAGE, seed=30 + page)
    put = PoolTransfer(PoolName.KV, host_indices=_indices(0, 2), keys=hashes)
    assert backend.batch_set_v2([put]) == {"kv": [True, True]}
    assert backend.batch_exists(hashes) == 2  # the same pages v1 / generic would have stored
    get = PoolTransfer(PoolName.KV, host_indices=_indices(4, 2), keys=hashes)
    assert backend.batch_get_v2([get]) == {"kv": [True, True]}
    for page in range(2):
        for c in (0, 1):
            assert torch.equal(kv.read((4 + page) * PAGE, c).view(torch.int16),
                               kv.read(page * PAGE, c).view(torch.int16))  # fmt: skip
    # Host indices that do not cover the pages are refused, nothing is stored.
    mamba = mamba_pool()
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    short = PoolTransfer(PoolName.MAMBA, host_indices=_one(1)[:0], keys=hashes[1:])
    assert backend.batch_set_v2([short]) == {"mamba": [False]}
    assert backend.batch_get_v2([short]) == {"mamba": [False]}
    backend.close()


def test_mamba_state_is_per_rank_even_for_mla(start_daemon: Any) -> None:
    daemon = start_daemon()
    hashes = _hashes(5, 2)
    transfer = [PoolTransfer(PoolName.MAMBA, host_indices=_one(1), keys=hashes[1:],
                             hit_policy=TRAIL)]  # fmt: skip
    engines = []
    for rank in (0, 1):
        kv, mamba, swa = _pools()
        url = daemon.url(retries="1", timeout="5")
        backend = _backend(_config(url, tp_rank=rank, mla=True), kv)
        engines.append(Engine(backend, kv, mamba, swa))
        fill_state(mamba, 1, seed=20 + rank)
    rank0, rank1 = engines
    # Rank 1 is not the MLA storage writer, yet writes its own shard of the state.
    assert rank1.backend.batch_set_v2(transfer) == {"mamba": [True]}
    assert rank0.backend.batch_set_v1(hashes, _indices(0, 2)) == [True, True]
    one = [PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAIL)]
    assert rank1.backend.batch_exists_v2(hashes, one).kv_hit_pages == 2
    assert rank0.backend.batch_exists_v2(hashes, one).kv_hit_pages == 0  # not its shard
    # A store that is down: misses and failed writes, never an exception into SGLang.
    daemon.stop()
    assert _as_tuple(rank1.backend.batch_exists_v2(hashes, one)) == (0, {}, [])
    assert rank1.backend.batch_get_v2(transfer) == {"mamba": [False]}
    assert rank1.backend.batch_set_v2(transfer) == {"mamba": [False]}
    for engine in engines:
        engine.backend.close()


def test_lossy_codecs_are_refused() -> None:
    with pytest.raises(ConfigError, match="MAMBA .recurrent state"):
        KVOffloadHiCacheStorage(_config("local://", codec="fp8"))
    with pytest.raises(ConfigError, match="codec"):
        KVOffloadHiCacheStorage(_config("local://", codec="nope"))
