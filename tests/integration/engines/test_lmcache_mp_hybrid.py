"""Hybrid models in LMCache 0.5.6's multiprocess mode, with KVOffloadL2Adapter as its L2.

LMCache passes a hybrid model's recurrent state (vLLM's Mamba / gated-delta-net groups in
``mamba_cache_mode="align"``) as object groups of their own: `kv_layer_groups.py` buckets the
recurrent kernel groups apart from attention, `distributed/api.py` gives every (object group,
kv rank) a row of `GroupedObjectKeys` whose ``sliding_window_size`` is the group's window (one
chunk for a state), and the prefetch controller folds the rows' hits
(`bitmap_ops/fold.fold_unfold_grouped`, after the loads in `_finish_request`). The adapter
sees a state as an ordinary object of its group. Here LMCache's own `StorageManager` (built by
the MP server's argument parser, as in `test_lmcache_mp.py`) stores attention KV for every
chunk and a state only at some chunks, and a fresh one prefetches both rows: each object
bit-exact, each planted failure ending the hit where LMCache's fold puts it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("lmcache", "KVOFFLOAD_REQUIRE_LMCACHE")

import torch  # noqa: E402
from lmcache.v1.distributed.api import (  # noqa: E402
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402
from test_lmcache_mp import LAYOUT, MODEL, PATIENCE_S, Managers, _adapter  # noqa: E402

from kvoffload.client_sdk import Client  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ATTENTION, STATE = 0, 1
# A Mamba state page: float32 SSM state and conv state, one object per chunk boundary.
STATE_LAYOUT = MemoryLayoutDesc([torch.Size([2, 48])], [torch.float32])
CHUNKS = 4
STATE_AT = (1, 3)  # chunk boundaries the engine kept a state for


@pytest.fixture
def managers() -> Iterator[Managers]:
    made = Managers()
    yield made
    for manager in list(made.open):
        made.close(manager)


def _keys(group: int) -> list[ObjectKey]:
    return [
        ObjectKey(bytes([0x40 + i]) * 16, MODEL, 0, object_group_id=group) for i in range(CHUNKS)
    ]


def _store(
    manager: StorageManager, keys: list[ObjectKey], layout: MemoryLayoutDesc, seed: int
) -> dict[ObjectKey, bytes]:
    """Write random objects for `keys` into L1 and wait until the adapter has stored them."""
    objs = manager.reserve_write(keys, layout)
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


def _prefetch(manager: StorageManager) -> tuple[list[list[int]], dict[ObjectKey, bytes]]:
    """Prefetch both rows as LMCache's lookup does for a hybrid model; returns the hit chunk
    indices per row and the bytes of every hit object."""
    rows = [
        GroupedObjectKeys(_keys(ATTENTION), ATTENTION, LAYOUT),
        GroupedObjectKeys(_keys(STATE), STATE, STATE_LAYOUT, sliding_window_size=1),
    ]
    handle = manager.submit_prefetch_task(PrefetchTaskSpec(rows))
    assert manager.wait_prefetch_status(handle, PATIENCE_S)
    result = manager.query_prefetch_status(handle)
    assert result is not None
    hits = [list(cells.get_indices_list()) for cells in result.hit_cells]
    keys = [row.keys[i] for row, hit in zip(rows, hits, strict=True) for i in hit]
    if not keys:
        return hits, {}
    with manager.read_prefetched_results(keys, result.l1_owners) as objs:
        assert objs is not None
        data = {k: bytes(o.byte_array) for k, o in zip(keys, objs, strict=True)}
    manager.finish_read_prefetched(keys, 1, result.l1_owners)
    return hits, data


def test_recurrent_state_objects_are_stored_and_loaded_verified(
    start_daemon: Any, managers: Any
) -> None:
    url = start_daemon().url()
    writer = managers(url)
    written = _store(writer, _keys(ATTENTION), LAYOUT, seed=1)
    states = [_keys(STATE)[i] for i in STATE_AT]
    written |= _store(writer, states, STATE_LAYOUT, seed=2)
    store_key = {k: _adapter(writer)._hashes([k])[0] for k in written}
    managers.close(writer)
    raw = Client.connect(url)

    # The longest prefix whose last chunk has a state: all 4 chunks of KV, the state at 3.
    hits, data = _prefetch(managers(url))
    assert hits == [[0, 1, 2, 3], [3]]
    assert data == {k: written[k] for k in data} and len(data) == 5

    # The state at chunk 3 damaged: LMCache planned that one state, its load fails, and the
    # fold leaves no chunk to serve; the engine recomputes.
    last = _keys(STATE)[3]
    damage_stored_block(url, store_key[last], -7)
    held = raw.transport.get(store_key[last][:16])
    assert held is not None and written[last] not in bytes(held.data)  # negative control
    held.release()
    reader = managers(url)
    assert _prefetch(reader) == ([[], []], {})
    assert _adapter(reader).report_status()["load_failed"] >= 1

    # The state at chunk 3 missing: the hit ends at the boundary of chunk 1, bit-exact.
    assert raw.transport.delete(store_key[last][:16])
    hits, data = _prefetch(managers(url))
    assert hits == [[0, 1], [1]]
    assert data == {k: written[k] for k in data} and len(data) == 3

    # No state at all: no hit, whatever KV is stored.
    assert raw.transport.delete(store_key[_keys(STATE)[1]][:16])
    assert _prefetch(managers(url)) == ([[], []], {})
    raw.close()
