"""KVOffloadHiCacheStorage through SGLang 0.5.23's real storage interface, against a live
`kvoffload serve`.

SGLang's own `StorageBackendFactory` loads the backend the way ``--hicache-storage-backend
dynamic`` does, page keys come from SGLang's own page hash (`get_storage_hash_str`), and the
backend is driven through the `HiCacheStorage` methods SGLang's cache controller calls: the
zero-copy ``*_v1`` methods with host indices, the generic ones with flat pages, and
`batch_exists` for the leading-hit count.

The host pool is a test pool: SGLang's real `MHATokenToKVPoolHost` cannot be imported on a
CPU-only machine (its package pulls SGLang's model and kernel stack, which needs CUDA builds of
torch and torchvision), so `HostPool` below keeps an MHA pool's K/V buffer in SGLang's
``page_first`` and ``layer_first`` layouts and reports page buffers the way the interface
describes (per page: K then V, per layer for ``layer_first``).
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("sglang", "KVOFFLOAD_REQUIRE_SGLANG")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvoffload.client_sdk import engine_hashes  # noqa: E402
from kvoffload.connectors.sglang import KVOffloadHiCacheStorage  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PAGE = 16
LAYERS = 3
HEADS = 2
DIM = 8


class HostPool:
    """An MHA host KV pool: K/V of every layer for `size` token slots, in pages."""

    def __init__(self, layout: str, size: int = 16 * PAGE) -> None:
        self.layout = layout
        self.page_size = PAGE
        self.size = size
        self.dtype = torch.bfloat16
        self.layer_num = LAYERS
        self.head_num = HEADS
        self.head_dim = DIM
        dims = (size, LAYERS) if layout == "page_first" else (LAYERS, size)
        self.kv_buffer = torch.zeros((2, *dims, HEADS, DIM), dtype=self.dtype)

    def _page(self, component: int, index: int, layer: int | None = None) -> torch.Tensor:
        if self.layout == "page_first":
            return self.kv_buffer[component, index : index + PAGE]
        return self.kv_buffer[component, layer, index : index + PAGE]

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        ptrs, sizes = [], []
        for index in indices.tolist()[::PAGE]:
            layers = [None] if self.layout == "page_first" else list(range(LAYERS))
            for layer in layers:
                for component in (0, 1):  # K, then V
                    part = self._page(component, index, layer)
                    assert part.is_contiguous()
                    ptrs.append(part.data_ptr())
                    sizes.append(part.numel() * part.element_size())
        return ptrs, sizes

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = torch.stack([self.read(index, c) for c in (0, 1)])
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * PAGE * LAYERS * HEADS * DIM, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, page: torch.Tensor) -> None:
        """The inverse of `get_data_page` (SGLang's pools have both)."""
        data = page.view(2, LAYERS, PAGE, HEADS, DIM)
        for component in (0, 1):
            if self.layout == "page_first":
                self.kv_buffer[component, index : index + PAGE] = data[component].transpose(0, 1)
            else:
                self.kv_buffer[component, :, index : index + PAGE] = data[component]

    def read(self, index: int, component: int) -> torch.Tensor:
        """One component of a page as [layer, token, head, dim], whatever the layout."""
        if self.layout == "page_first":
            return self.kv_buffer[component, index : index + PAGE].transpose(0, 1).clone()
        return self.kv_buffer[component, :, index : index + PAGE].clone()

    def fill(self, index: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for component in (0, 1):
            data = torch.randn((LAYERS, PAGE, HEADS, DIM), generator=g).to(self.dtype)
            if self.layout == "page_first":
                self.kv_buffer[component, index : index + PAGE] = data.transpose(0, 1)
            else:
                self.kv_buffer[component, :, index : index + PAGE] = data


def _config(url: str, *, zero_copy: bool = True, tp_rank: int = 0, mla: bool = False,
            **extra: Any) -> HiCacheStorageConfig:  # fmt: skip
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="org/tiny-model",
        extra_config={
            "backend_name": "kvoffload",
            "module_path": "kvoffload.connectors.sglang",
            "class_name": "KVOffloadHiCacheStorage",
            "interface_v1": 1 if zero_copy else 0,
            "url": url,
            **extra,
        },
    )  # fmt: skip


def _backend(config: HiCacheStorageConfig, pool: HostPool) -> Any:
    """What SGLang's cache controller does when it attaches a storage backend."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def _indices(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def _tokens(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(pages * PAGE)]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_zero_copy_round_trip_and_leading_hits(start_daemon: Any, layout: str) -> None:
    daemon = start_daemon()
    pool = HostPool(layout)
    backend = _backend(_config(daemon.url()), pool)
    assert isinstance(backend, KVOffloadHiCacheStorage) and isinstance(backend, HiCacheStorage)
    keys = get_storage_hash_str(_tokens(1, 4), None, page_size=PAGE)
    assert len(keys) == 4
    for page in range(4):
        pool.fill(page * PAGE, seed=page)
    expected = [[pool.read(page * PAGE, c) for c in (0, 1)] for page in range(4)]
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, _indices(0, 4)) == [True] * 4
    assert backend.batch_exists(keys) == 4
    # Back into other host slots, bit for bit.
    assert backend.batch_get_v1(keys, _indices(8, 4)) == [True] * 4
    for page in range(4):
        for c in (0, 1):
            got = pool.read((8 + page) * PAGE, c)
            assert torch.equal(got.view(torch.int16), expected[page][c].view(torch.int16))

    # Leading hits only: a sequence stored with a gap (pages 0, 1 and 3) counts 2.
    other = get_storage_hash_str(_tokens(2, 4), None, page_size=PAGE)
    info = HiCacheStorageExtraInfo(prefix_keys=other[:3])
    assert backend.batch_set_v1(other[:2], _indices(0, 2)) == [True, True]
    assert backend.batch_set_v1(other[3:], _indices(3, 1), info) == [True]
    assert backend.batch_exists(other) == 2
    assert backend.batch_exists(other[3:]) == 1
    assert backend.exists(other[0]) and not backend.exists(other[2])
    # A page whose part is missing reads as a failure, the pages around it still load.
    assert backend.batch_get_v1(other, _indices(8, 4)) == [True, True, False, True]
    backend.close()


def test_generic_interface_round_trip(start_daemon: Any) -> None:
    daemon = start_daemon()
    pool = HostPool("page_first")
    backend = _backend(_config(daemon.url(), zero_copy=False), pool)
    keys = get_storage_hash_str(_tokens(3, 3), None, page_size=PAGE)
    for page in range(3):
        pool.fill(page * PAGE, seed=10 + page)
    pages = [pool.get_data_page(page * PAGE) for page in range(3)]
    assert backend.batch_set(keys, pages)
    assert backend.batch_exists(keys) == 3
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for page, tensor in zip(pages, got, strict=True):
        assert tensor is not None and torch.equal(tensor.view(torch.int16), page.view(torch.int16))
    assert backend.get(keys[0], pool.get_dummy_flat_data_page()) is not None
    missing = get_storage_hash_str(_tokens(4, 1), None, page_size=PAGE)[0]
    assert backend.get(missing, pool.get_dummy_flat_data_page()) is None
    # Pages written through one interface are not read through the other (other bytes).
    zero_copy = _backend(_config(daemon.url()), pool)
    assert zero_copy.batch_exists(keys) == 0
    backend.close()
    zero_copy.close()


def test_a_damaged_page_is_a_failed_read_never_wrong_bytes(start_daemon: Any) -> None:
    daemon = start_daemon()
    pool = HostPool("page_first")
    backend = _backend(_config(daemon.url()), pool)
    keys = get_storage_hash_str(_tokens(5, 2), None, page_size=PAGE)
    pool.fill(0, seed=1)
    pool.fill(PAGE, seed=2)
    assert backend.batch_set_v1(keys, _indices(0, 2)) == [True, True]
    # Flip one byte of the second page's V part behind the SDK's back.
    v_part = engine_hashes(backend.namespace, [f"{keys[1]}\0v1/1".encode()])[0]
    damage_stored_block(daemon.url(), v_part, -3)
    pool.kv_buffer[:, 8 * PAGE : 10 * PAGE] = 1
    assert backend.batch_get_v1(keys, _indices(8, 2)) == [True, False]
    # The damaged part was not left in host memory.
    assert not torch.equal(pool.read(9 * PAGE, 1), pool.read(PAGE, 1))
    assert backend.get_stats()["failed_reads"] == 1
    backend.close()


def test_pages_are_namespaced_by_rank_and_shared_for_mla(start_daemon: Any) -> None:
    daemon = start_daemon()
    pool = HostPool("page_first")
    keys = get_storage_hash_str(_tokens(6, 2), None, page_size=PAGE)
    rank0 = _backend(_config(daemon.url(), tp_rank=0), pool)
    rank1 = _backend(_config(daemon.url(), tp_rank=1), pool)
    assert rank0.batch_set_v1(keys, _indices(0, 2)) == [True, True]
    assert rank1.batch_exists(keys) == 0  # another shard of the heads
    salted = _backend(_config(daemon.url(), salt="tenant-b"), pool)
    assert salted.batch_exists(keys) == 0
    mla0 = _backend(_config(daemon.url(), tp_rank=0, mla=True), pool)
    mla1 = _backend(_config(daemon.url(), tp_rank=1, mla=True), pool)
    assert mla1.batch_set_v1(keys, _indices(0, 2)) == [True, True]  # not the writer rank
    assert mla1.batch_exists(keys) == 0
    assert mla0.batch_set_v1(keys, _indices(0, 2)) == [True, True]
    assert mla1.batch_exists(keys) == 2  # MLA pages are the same on every rank
    for backend in (rank0, rank1, salted, mla0, mla1):
        backend.close()


def test_a_store_that_is_down_means_misses(start_daemon: Any) -> None:
    daemon = start_daemon()
    pool = HostPool("page_first")
    backend = _backend(_config(daemon.url(retries="1", timeout="5")), pool)
    keys = get_storage_hash_str(_tokens(7, 2), None, page_size=PAGE)
    assert backend.batch_set_v1(keys, _indices(0, 2)) == [True, True]
    daemon.stop()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, _indices(8, 2)) == [False, False]
    assert backend.batch_set_v1(keys[:1], _indices(0, 1)) == [False]
    backend.close()


def test_bad_extra_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown HiCache extra config"):
        KVOffloadHiCacheStorage(_config("kv://127.0.0.1:9", typo=1))
    with pytest.raises(ConfigError, match="url"):
        KVOffloadHiCacheStorage(_config(""))
