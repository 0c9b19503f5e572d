"""`kvoffload bench <name>`: name -> module defining HELP, add_arguments(parser) and
run_from_args(args) -> BenchResult.

Modules are imported to build the parser, so they must not import heavy optional packages
(torch, peers) at module level. This table has a module of its own so that `bench report`, which
runs the other benches, can read it without importing the command line.
"""

from __future__ import annotations

__all__ = ["BENCHES"]

BENCHES: dict[str, str] = {
    "engine": "kvoffload.bench.engine_bench",
    "ssd": "kvoffload.bench.ssd_bench",
    "net": "kvoffload.bench.net",
    "codecs": "kvoffload.bench.codecs",
    "nvme": "kvoffload.bench.nvme_bench",
    "trace": "kvoffload.bench.trace",
    "fuzz": "kvoffload.bench.fuzz",
    "cluster": "kvoffload.bench.cluster_bench",
    "lmcache-mp": "kvoffload.bench.lmcache_mp",
    "serve": "kvoffload.bench.serve",
    # Last: it runs the benches above.
    "report": "kvoffload.bench.report",
}
