"""`kvoffload bench lmcache-mp` against LMCache 0.5.6's own fs L2 adapter, at a tiny size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from engine_env import require_engine

require_engine("lmcache", "KVOFFLOAD_REQUIRE_LMCACHE")

from kvoffload.bench.peers.lmcache_mp import run  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_lmcache_mp_bench_has_its_rows(tmp_path: Path) -> None:
    result = run(size=256 << 10, keys=2, in_flight=2, rounds=2, trials=1, root=str(tmp_path),
                 lmcache_python=sys.executable)  # fmt: skip
    assert not result.notes, result.notes  # no phase failed, every load returned its bytes
    rows = {r.case: r for r in result.rows}
    assert set(rows) == {
        "lmcache_mp_load/256KiB",
        "lmcache_mp_store/256KiB",
        "lmcache_mp_load_kv/256KiB",
        "lmcache_mp_store_kv/256KiB",
    }
    for row in rows.values():
        assert row.ref == "lmcache-fs"
        assert row.value > 0 and row.ref_value is not None and row.ref_value > 0
        assert "LMCache 0.5.6 fs adapter" in row.note
    assert not list(tmp_path.iterdir())  # the working sets are removed
