"""KVOffloadL2Adapter inside LMCache 0.5.6's multiprocess (MP) mode.

The storage managers here are LMCache's own MP-server storage core (`StorageManager`: L1
manager, store and prefetch controllers driving the adapter through its event fds), configured
by the MP server's own argument parser from the same ``--l2-adapter`` JSON a user passes to
``python -m lmcache.v1.multiprocess.server``; one test starts that server itself. One manager
stores, a fresh one (empty L1) prefetches and the bytes are compared. Nothing of LMCache is
mocked; the serving engine is not needed, since MP mode moves KV in and out of L1 itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("lmcache", "KVOFFLOAD_REQUIRE_LMCACHE")

import torch  # noqa: E402
from lmcache.cli.commands.bench.l2_adapter_bench.data import (  # noqa: E402
    make_aligned_tensor,
    make_memory_objects,
    wait_eventfd,
)
from lmcache.v1.distributed.api import (  # noqa: E402
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import get_arg_parser, parse_args_to_config  # noqa: E402
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface  # noqa: E402
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402

from kvoffload.bench.common import free_port  # noqa: E402
from kvoffload.connectors.lmcache_mp import KVOffloadL2Adapter  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LAYOUT = MemoryLayoutDesc([torch.Size([2, 2, 16, 64])], [torch.bfloat16])  # 8 KiB objects
MODEL = "org/tiny-model"
# Bounds a wait for something that must happen; never a measurement.
PATIENCE_S = 60.0


def _spec(url: str, **params: Any) -> str:
    return json.dumps({
        "type": "plugin",
        "module_path": "kvoffload.connectors.lmcache_mp",
        "class_name": "KVOffloadL2Adapter",
        "adapter_params": {"url": url, **params},
    })  # fmt: skip


def _manager(url: str, **params: Any) -> StorageManager:
    """A storage manager as the MP server builds it from its command line."""
    argv = [
        "--l1-size-gb",
        "0.05",
        "--eviction-policy",
        "LRU",
        "--l2-adapter",
        _spec(url, **params),
    ]
    args = get_arg_parser().parse_args(argv)
    # The MP server's --shm-name: by default every L1 of a process shares one name.
    args.shm_name = f"kvoffload_test_{uuid.uuid4().hex[:12]}"
    return StorageManager(parse_args_to_config(args))


class Managers:
    """Storage managers made by a test; whatever it did not close is closed after it
    (LMCache's `StorageManager.close` may run only once)."""

    def __init__(self) -> None:
        self.open: list[StorageManager] = []

    def __call__(self, url: str, **params: Any) -> StorageManager:
        self.open.append(_manager(url, **params))
        return self.open[-1]

    def close(self, manager: StorageManager) -> None:
        self.open.remove(manager)
        manager.close()


@pytest.fixture
def managers() -> Iterator[Managers]:
    made = Managers()
    yield made
    for manager in list(made.open):
        made.close(manager)


def _adapter(manager: StorageManager) -> KVOffloadL2Adapter:
    (adapter,) = [a for _, a in manager.l2_adapters()]
    assert isinstance(adapter, KVOffloadL2Adapter)
    return adapter


def _keys(n: int, rank: int = 0, start: int = 0) -> list[ObjectKey]:
    # The same chunk hashes for every rank: only the other fields tell the keys apart.
    return [ObjectKey(bytes([start + i]) * 16, MODEL, rank) for i in range(n)]


def _store(manager: StorageManager, keys: list[ObjectKey], seed: int) -> dict[ObjectKey, bytes]:
    """Write random KV for `keys` into L1 and wait until the store controller has put all of it
    into the adapter; returns the bytes written."""
    objs = manager.reserve_write(keys, LAYOUT)
    assert len(objs) == len(keys)
    g = torch.Generator().manual_seed(seed)
    for obj in objs.values():
        obj.tensor.view(-1).copy_(torch.randn(obj.tensor.numel(), generator=g))
    written = {k: bytes(o.byte_array) for k, o in objs.items()}
    adapter = _adapter(manager)
    before = adapter.report_status()["stored"]
    manager.finish_write(keys)
    deadline = time.monotonic() + PATIENCE_S
    while adapter.report_status()["stored"] < before + len(keys):
        assert time.monotonic() < deadline, adapter.report_status()
        time.sleep(0.02)
    return written


def _prefetch(
    manager: StorageManager, rows: list[list[ObjectKey]]
) -> tuple[list[int], list[bytes]]:
    """Prefetch `rows` (one key group each) from L2; returns the hits per row and the bytes of
    the hit objects, row by row."""
    spec = PrefetchTaskSpec([GroupedObjectKeys(keys, 0, LAYOUT) for keys in rows])
    handle = manager.submit_prefetch_task(spec)
    assert manager.wait_prefetch_status(handle, PATIENCE_S)
    result = manager.query_prefetch_status(handle)
    assert result is not None
    hits = [row.popcount() for row in result.hit_cells]
    keys = [k for keys, n in zip(rows, hits, strict=True) for k in keys[:n]]
    if not keys:
        return hits, []
    with manager.read_prefetched_results(keys, result.l1_owners) as objs:
        assert objs is not None
        data = [bytes(o.byte_array) for o in objs]
    manager.finish_read_prefetched(keys, 1, result.l1_owners)
    return hits, data


def _urls(kind: str, tmp_path: Path, start_daemon: Any) -> str:
    if kind == "local":
        return f"local://{tmp_path}/store?dram=64MiB&max_value=4MiB&ssd=64MiB"
    if kind == "kv":
        return str(start_daemon().url())
    nodes = [start_daemon() for _ in range(2)]
    return "cluster://" + ",".join(f"127.0.0.1:{d.port}" for d in nodes) + "?replicas=1"


@pytest.mark.parametrize("kind", ["local", "kv", "cluster"])
def test_one_mp_server_stores_and_a_fresh_one_retrieves_bit_exact(
    kind: str, tmp_path: Path, start_daemon: Any, managers: Any
) -> None:
    url = _urls(kind, tmp_path, start_daemon)
    writer = managers(url)
    rank0, rank1 = _keys(5, rank=0), _keys(5, rank=1)
    written = _store(writer, rank0, seed=1) | _store(writer, rank1, seed=2)
    assert written[rank0[0]] != written[rank1[0]]  # same chunk hash, other rank, other KV
    managers.close(writer)  # a local:// store is reopened from its SSD tier by the reader

    reader = managers(url)
    hits, data = _prefetch(reader, [rank0, rank1])
    assert hits == [5, 5]
    assert data == [written[k] for k in rank0 + rank1]
    assert _adapter(reader).report_status()["loaded"] == 10


def test_a_salt_and_other_fields_keep_keys_apart(start_daemon: Any, managers: Any) -> None:
    url = start_daemon().url()
    writer = managers(url)
    keys = _keys(3)
    _store(writer, keys, seed=3)
    salted = managers(url, salt="tenant-b")
    assert _prefetch(salted, [keys])[0] == [0]
    other_group = [ObjectKey(k.chunk_hash, MODEL, 0, object_group_id=1) for k in keys]
    other_salt = [ObjectKey(k.chunk_hash, MODEL, 0, cache_salt="u1") for k in keys]
    plain = managers(url)
    assert _prefetch(plain, [other_group])[0] == [0]
    assert _prefetch(plain, [other_salt])[0] == [0]
    assert _prefetch(plain, [keys])[0] == [3]


def _wait_result(adapter: KVOffloadL2Adapter, efd: int, query: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + PATIENCE_S
    while True:
        result = query()
        if result is not None:
            return result
        assert time.monotonic() < deadline, "the adapter never completed the task"
        wait_eventfd(efd, timeout=1.0)


def _load(adapter: KVOffloadL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> list[int]:
    task = adapter.submit_load_task(keys, objs)
    bitmap = _wait_result(
        adapter, adapter.get_load_event_fd(), lambda: adapter.query_load_result(task)
    )
    assert adapter.query_load_result(task) is None  # a result is returned once
    return [int(i in bitmap.get_indices_list()) for i in range(len(keys))]


def _lookup(adapter: KVOffloadL2Adapter, keys: list[ObjectKey]) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(keys, {0: LAYOUT})
    bitmap = _wait_result(
        adapter,
        adapter.get_lookup_and_lock_event_fd(),
        lambda: adapter.query_lookup_and_lock_result(task),
    )
    return [int(i in bitmap.get_indices_list()) for i in range(len(keys))]


def _store_direct(adapter: KVOffloadL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> bool:
    """Only for an adapter no storage manager owns: its store controller pops every finished
    store task."""
    task = adapter.submit_store_task(keys, objs)
    done: dict[int, Any] = {}

    def popped() -> Any:
        done.update(adapter.pop_completed_store_tasks())
        return done.get(task)

    return bool(_wait_result(adapter, adapter.get_store_event_fd(), popped).is_successful())


def test_a_damaged_block_ends_the_hit_at_that_key(start_daemon: Any, managers: Any) -> None:
    daemon = start_daemon()
    writer = managers(daemon.url())
    keys = _keys(4)
    written = _store(writer, keys, seed=4)
    adapter = _adapter(writer)
    damage_stored_block(daemon.url(), adapter._hashes([keys[1]])[0])

    # Straight through the adapter: chunk 1 fails, and 2 and 3 with it though they are intact.
    objs = [writer.reserve_write([k], LAYOUT)[k] for k in _keys(4, start=100)]
    assert _load(adapter, keys, objs) == [1, 0, 0, 0]
    assert bytes(objs[0].byte_array) == written[keys[0]]
    assert not any(bytes(objs[1].byte_array))  # the damaged bytes never stay in L1

    # Through LMCache's prefetch: the hit is chunk 0 alone, bit-exact.
    hits, data = _prefetch(managers(daemon.url()), [keys])
    assert hits == [1]
    assert data == [written[keys[0]]]


def test_the_daemon_stopped_mid_run_means_misses_not_a_hang(
    start_daemon: Any, managers: Any
) -> None:
    daemon = start_daemon()
    url = daemon.url(retries="1")  # a stopped daemon refuses at once: no deadline needed
    manager = managers(url)
    keys = _keys(3)
    _store(manager, keys, seed=5)
    adapter = _adapter(manager)
    assert _lookup(adapter, keys) == [1, 1, 1]
    daemon.stop()

    objs = [manager.reserve_write([k], LAYOUT)[k] for k in _keys(3, start=50)]
    assert _lookup(adapter, keys) == [0, 0, 0]
    assert _load(adapter, keys, objs) == [0, 0, 0]
    # A store through LMCache's store controller (which pops every finished store task).
    more = _keys(3, start=60)
    written = manager.reserve_write(more, LAYOUT)
    assert len(written) == len(more)
    manager.finish_write(more)
    deadline = time.monotonic() + PATIENCE_S
    while adapter.report_status()["store_failed"] < len(more):
        assert time.monotonic() < deadline, adapter.report_status()
        time.sleep(0.02)
    assert _prefetch(managers(url), [keys])[0] == [0]
    assert adapter.report_status()["is_healthy"]


def test_the_contract_lmcache_relies_on(tmp_path: Path) -> None:
    adapter = KVOffloadL2Adapter({"url": "local://?dram=64MiB&max_value=4MiB"})
    try:
        fds = {
            adapter.get_store_event_fd(),
            adapter.get_lookup_and_lock_event_fd(),
            adapter.get_load_event_fd(),
        }
        assert len(fds) == 3
        assert type(adapter).delete is not L2AdapterInterface.delete
        adapter.delete(_keys(2))  # absent keys: nothing to do, nothing raised
        # LMCache's own benchmark builds its objects this way (views of one L1 buffer).
        objs = make_memory_objects(make_aligned_tensor(2 * 8192, 4096), 2, 8192, 0)
        assert _store_direct(adapter, _keys(2), objs)
        assert adapter.get_usage().total_bytes_used == 2 * 8192
        adapter.delete(_keys(3))  # two present, one absent
        assert _lookup(adapter, _keys(2)) == [0, 0]
        assert adapter.get_usage().total_bytes_used == 0
    finally:
        adapter.close()
    adapter.close()  # idempotent


class _CountingClient:
    """The adapter's real client, with its existence questions counted (every call reaches
    the store)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.exists_calls = 0
        self.exists_many_keys: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def exists(self, key: bytes) -> bool:
        self.exists_calls += 1
        return bool(await self._client.exists(key))

    async def exists_many(self, keys: list[bytes]) -> list[bool]:
        self.exists_many_keys.append(len(keys))
        return list(await self._client.exists_many(keys))


@pytest.mark.parametrize("kind", ["local", "kv"])
def test_a_lookup_past_a_gap_asks_the_rest_in_one_batch(kind: str, start_daemon: Any) -> None:
    url = "local://?dram=64MiB&max_value=4MiB" if kind == "local" else start_daemon().url()
    adapter = KVOffloadL2Adapter({"url": url, "prefetch": False})
    try:
        keys = _keys(6)
        stored = [k for i, k in enumerate(keys) if i != 2]  # a gap at chunk 2
        objs = make_memory_objects(make_aligned_tensor(5 * 8192, 4096), 5, 8192, 0)
        assert _store_direct(adapter, stored, objs)
        counting = _CountingClient(adapter.client)
        adapter.client = counting  # type: ignore[assignment]

        # Every stored key answers for itself, the ones after the gap too.
        assert _lookup(adapter, keys) == [1, 1, 0, 1, 1, 1]
        # One batch for the three keys after the gap, not a request per key.
        assert counting.exists_many_keys == [3]
        assert counting.exists_calls == 0
        # A chain stored whole is one lookup and nothing more.
        assert _lookup(adapter, keys[:2]) == [1, 1]
        assert counting.exists_many_keys == [3]
    finally:
        adapter.close()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({}, "url"),
        ({"url": "kv://127.0.0.1:9", "typo": 1}, "unknown adapter_params"),
        ({"url": "nope"}, "not a store URL"),
        ({"url": "kv://127.0.0.1:9", "prefetch": "yes"}, "prefetch"),
    ],
)
def test_bad_adapter_params_are_refused(params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVOffloadL2Adapter(params)


def test_lmcache_mp_server_starts_with_the_adapter(tmp_path: Path) -> None:
    """`python -m lmcache.v1.multiprocess.server` parses the documented --l2-adapter JSON and
    builds the adapter (which creates the local:// store); bad params stop it with our error."""
    store = tmp_path / "store"

    def server(spec: str) -> subprocess.Popen[str]:
        args = [
            sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
            "--port", str(free_port()), "--l1-size-gb", "0.05", "--eviction-policy", "LRU",
            "--disable-observability", "--l2-adapter", spec,
        ]  # fmt: skip
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    proc = server(_spec(f"local://{store}?dram=64MiB&max_value=4MiB&ssd=64MiB"))
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends at EOF if it exits
            lines.append(line)
            if "cache server is running..." in line:
                break
        assert (store / "kvoffload.meta").exists(), "".join(lines[-30:])
    finally:
        proc.terminate()
        proc.wait(PATIENCE_S)

    bad = server(_spec("local://", typo=1))
    out, _ = bad.communicate(timeout=PATIENCE_S * 2)
    assert bad.returncode != 0
    assert "unknown adapter_params key(s) ['typo']" in out
