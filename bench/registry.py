"""`kvoffload bench <name>`: name -> module defining HELP, add_arguments(parser) and
run_from_args(args) -> BenchResult.

Modules are imported to build the parser, so they must not import heavy optional packages
(torch, peers) at module level. This table has a module of its own so that `bench report`, which
runs the other benches, can read it without importing the command line.
"""

from __future__ import annotations

__all__ = ["BENCHES"]

BENCHES: dict[str, str] = {
    "engine": "kvoffload.bench.micro.engine_bench",
    "ssd": "kvoffload.bench.micro.ssd_bench",
    "net": "kvoffload.bench.micro.net",
    "codecs": "kvoffload.bench.micro.codecs",
    "nvme": "kvoffload.bench.micro.nvme_bench",
    "trace": "kvoffload.bench.trace.trace_bench",
    "fuzz": "kvoffload.bench.fuzz.fuzz_bench",
    "cluster": "kvoffload.bench.cluster.cluster_bench",
    "lmcache-mp": "kvoffload.bench.peers.lmcache_mp",
    "serve": "kvoffload.bench.serve.serve_bench",
    # Last: it runs the benches above.
    "report": "kvoffload.bench.trace.report",
}
