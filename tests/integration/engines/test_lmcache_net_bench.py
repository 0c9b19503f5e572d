"""`kvoffload bench net` against LMCache 0.5.6's own lm:// server (the `lmcache` reference)."""

from __future__ import annotations

import sys

import pytest
from engine_env import require_engine

require_engine("lmcache", "KVOFFLOAD_REQUIRE_LMCACHE")

from kvoffload.bench.micro.net import run  # noqa: E402
from kvoffload.bench.peers import lmserver  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_lm_server_returns_what_was_put() -> None:
    rates = lmserver.measure(size=64 << 10, count=16, rounds=1, depth=4)
    assert set(rates) == {"put", "get", "put_pipelined", "get_pipelined"}
    assert all(rate > 0 for rate in rates.values())


def test_net_bench_has_lmcache_rows() -> None:
    result = run(working_set=1 << 20, rounds=1, sizes={"64KiB": 64 << 10}, lookups=5,
                 lmcache_python=sys.executable)  # fmt: skip
    rows = {(r.case, r.ref): r for r in result.rows}
    for op in ("put", "get", "put_pipelined", "get_pipelined"):
        row = rows[(f"{op}/64KiB", "lmcache")]
        assert row.ref_value is not None and row.ref_value > 0 and row.ratio
        assert row.note.startswith("LMCache 0.5.6 lm:// server")
