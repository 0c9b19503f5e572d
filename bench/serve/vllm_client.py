"""`bench serve --client vllm`: vLLM's own benchmark client (``vllm bench serve``) sends the
requests to the real servers `bench serve` starts.

Each configuration's requests go out as one run of ``vllm.benchmarks.serve`` (its ``main``,
in a subprocess of the engine's environment, `vllm_driver.py`) over a whole dataset, one
request at a time (``--max-concurrency 1``), greedy (``--temperature 0``, ``--ignore-eos``),
``--save-result --save-detailed`` into the results directory; TTFT, TPOT and ITL percentiles
are read from vLLM's own JSON. Datasets that work offline: ``prefix_repetition`` (vLLM's
generator) and ``custom`` (`bench trace`'s multi-turn sessions, written by `bench serve`, in
order). Configurations, every server pinned to the same cores:

- ``none``: a server without a prefix cache (nothing reused);
- ``apc``: vLLM's own prefix cache, resident: the server ran the dataset once before (``apc``'s
  first run is reported as ``apc_first``);
- ``kv``: kvoffload over ``kv://``, a fresh (warm) server each round on a daemon that holds the
  dataset's blocks (stored by the first round's first run, reported as ``kv_first``);
- ``kv_reset``: the same server right after, its prefix cache reset before the run.

Rounds interleave the configurations (their order rotating round by round), so a drift of the
shared machine over minutes hits each alike. vLLM's client cannot act between the requests of
one run: a cache salt of each request's own (our ``none``) or a prefix cache reset before each
request (our ``kv_reset``) cannot be expressed, so here ``none`` is a server without a prefix
cache and ``kv_reset`` resets before each run; our client keeps those rows (see
`serve_bench.py`).
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.bench.common import Row, Summary
from kvoffload.bench.serve.servers import MODEL_NAME, VllmServer, connector_transfer, daemon
from kvoffload.bench.trace.workload import Request
from kvoffload.errors import ConfigError

__all__ = [
    "CONFIGS",
    "DATASETS",
    "UNEXPRESSIBLE",
    "ClientRun",
    "Driver",
    "PrefixRepetition",
    "VllmResult",
    "parse_result",
    "rows_of",
    "run",
    "write_custom_dataset",
]

CONFIGS = ("none", "apc", "kv", "kv_reset")
DATASETS = ("prefix_repetition", "custom")
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl")
# Our client's rows that vLLM's client cannot express, and why (the output and the docs say it).
UNEXPRESSIBLE = {
    "none": "a cache salt of each request's own: vLLM's client sends one body for a whole run",
    "kv_reset": "a prefix cache reset before every request: vLLM's client cannot act between "
    "the requests of a run",
    "kv": "a fresh server per turn round: vLLM's client runs a dataset on one server",
    "kv_ssd": "not run with vLLM's client (kept short on a shared machine)",
    "vllm_offloading": "refuses to start on the CPU build",
}
_HITS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
_STORE_HITS = "vllm:external_prefix_cache_hits_total"


def write_custom_dataset(requests: Sequence[Request], path: Path,
                         decode: Callable[[Sequence[int]], str]) -> int:  # fmt: skip
    """vLLM's ``custom`` dataset (JSONL, ``prompt`` and ``output_tokens`` a line) from
    `requests`, in their order (vLLM's client keeps it with ``--disable-shuffle``); `decode`
    turns a prompt's token ids into the text vLLM's client sends (the model's tokenizer).
    Returns the number of lines.

    Raises:
        ConfigError: a request without token ids (a trace that names its blocks).
    """
    lines = []
    for request in requests:
        if request.tokens.size == 0:
            raise ConfigError(f"request {request.conversation}/{request.turn} has no token "
                              "ids: vLLM's custom dataset needs prompts")  # fmt: skip
        prompt = decode([int(t) for t in request.tokens])
        lines.append(json.dumps({"prompt": prompt, "output_tokens": int(request.output_tokens),
                                 "conversation": request.conversation,
                                 "turn": request.turn}))  # fmt: skip
    path.write_text("".join(line + "\n" for line in lines))
    return len(lines)


@dataclass(frozen=True)
class PrefixRepetition:
    """vLLM's ``prefix_repetition`` dataset: `prefixes` random prefixes of `prefix_len` tokens,
    each followed by `per_prefix` random suffixes of `suffix_len`."""

    prefix_len: int = 1536
    suffix_len: int = 64
    prefixes: int = 4
    per_prefix: int = 3

    def argv(self, output_len: int) -> list[str]:
        return ["--dataset-name", "prefix_repetition",
                "--num-prompts", str(self.prefixes * self.per_prefix),
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.suffix_len),
                "--prefix-repetition-num-prefixes", str(self.prefixes),
                "--prefix-repetition-output-len", str(output_len)]  # fmt: skip


@dataclass(frozen=True)
class VllmResult:
    """What one saved result of ``vllm bench serve`` says (times in ms, as vLLM writes them)."""

    path: Path
    completed: int
    failed: int
    percentiles: dict[str, float]  # "ttft_p50" ... "itl_p99"
    generated_texts: tuple[str, ...] = ()
    input_lens: tuple[int, ...] = ()


def parse_result(path: Path) -> VllmResult:
    """Read a JSON file ``vllm bench serve --save-result`` wrote (with ``--metric-percentiles
    50,90,99``; ``--save-detailed`` adds the generated texts).

    Raises:
        ConfigError: not such a file (unreadable, not JSON, a percentile missing).
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a vLLM result ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a vLLM result (a {type(data).__name__})")
    values: dict[str, float] = {}
    for metric in METRICS:
        for q in PERCENTILES:
            value = data.get(f"p{q}_{metric}_ms")
            if not isinstance(value, (int, float)):
                raise ConfigError(f"{path}: no p{q}_{metric}_ms (run with --metric-percentiles "
                                  "50,90,99 --percentile-metrics ttft,tpot,itl)")  # fmt: skip
            values[f"{metric}_p{q}"] = float(value)
    completed, failed = data.get("completed"), data.get("failed", 0)
    if not isinstance(completed, int) or not isinstance(failed, int):
        raise ConfigError(f"{path}: no request counts")
    texts = data.get("generated_texts") or []
    lens = data.get("input_lens") or []
    return VllmResult(path, completed, failed, values,
                      tuple(str(t) for t in texts), tuple(int(n) for n in lens))  # fmt: skip


class Driver:
    """`vllm_driver.py` in the engine's environment: one process, many runs of vLLM's client.

    Raises:
        RuntimeError: the driver died or a run failed (its message, and the driver's log).
    """

    def __init__(self, python: str, log: Path) -> None:
        self.log = log
        # In the log's folder: a source checkout as the working directory would put its
        # top-level `kvoffload/` first on sys.path, ahead of the installed package.
        with log.open("w") as err:
            self.proc = subprocess.Popen(
                [python, "-m", "kvoffload.bench.serve.vllm_driver"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, text=True, cwd=log.parent,
            )  # fmt: skip

    def call(self, command: Mapping[str, object]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it exited: the empty answer below says so
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"vLLM's benchmark client exited: {tail}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vLLM's benchmark client: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # it exited already
                self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass
class ClientRun:
    """One run of vLLM's client on one configuration's server."""

    config: str
    round: int
    result: VllmResult
    hit_tokens: int  # vLLM's prefix cache and the connector, as vLLM counts them
    store_hit_tokens: int  # the connector's share


@dataclass
class Plan:
    """What each run of vLLM's client gets: the dataset's arguments and the common ones."""

    model: Path
    results: Path
    dataset: list[str]
    output_len: int
    runs: list[ClientRun] = field(default_factory=list)

    def argv(self, server: VllmServer, name: str) -> list[str]:
        return [*self.dataset, "--backend", "vllm", "--host", "127.0.0.1",
                "--port", str(server.port), "--model", str(self.model),
                "--served-model-name", MODEL_NAME, "--tokenizer", str(self.model),
                "--max-concurrency", "1", "--temperature", "0", "--ignore-eos",
                "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl",
                "--metric-percentiles", ",".join(str(q) for q in PERCENTILES),
                "--save-result", "--save-detailed", "--result-dir", str(self.results),
                "--result-filename", f"{name}.json", "--label", name]  # fmt: skip


def _send(driver: Driver, plan: Plan, server: VllmServer, config: str, rnd: int) -> None:
    name = f"vllm-{config}-round{rnd}"
    before = server.metrics()
    driver.call({"bench": plan.argv(server, name)})
    after = server.metrics()
    hits = sum(after.get(k, 0.0) - before.get(k, 0.0) for k in _HITS)
    store = after.get(_STORE_HITS, 0.0) - before.get(_STORE_HITS, 0.0)
    result = parse_result(plan.results / f"{name}.json")
    plan.runs.append(ClientRun(config, rnd, result, int(hits), int(store)))


@contextlib.contextmanager
def _maybe(enabled: bool, start: Callable[[], VllmServer]) -> Iterator[VllmServer | None]:
    if not enabled:
        yield None
        return
    with start() as server:
        yield server


def run(
    *,
    driver: Driver,
    plan: Plan,
    configs: Sequence[str],
    rounds: int,
    start: Callable[..., VllmServer],
    warm: Callable[[VllmServer, bool], None],
    scratch: Path,
    dram: str,
    gap_s: float,
) -> list[ClientRun]:
    """`rounds` runs of every configuration, their order rotating round by round; `start`
    starts a server (a name, then VllmServer's keywords), `warm` warms it (first forward,
    save, load) before its first run."""
    wanted = set(configs)
    connector = bool(wanted & {"kv", "kv_reset"})
    with (
        daemon(scratch / "store-vllm-client", dram=dram) as store,
        _maybe("none" in wanted, lambda: start("vllm-none", prefix_caching=False)) as none,
        _maybe("apc" in wanted, lambda: start("vllm-apc")) as apc,
    ):
        for server in (none, apc):
            if server is not None:
                warm(server, False)
        if apc is not None:
            _send(driver, plan, apc, "apc_first", 0)  # its prefix cache now holds the dataset
        for rnd in range(1, rounds + 1):
            lanes: list[Callable[[], None]] = []
            if none is not None:
                lanes.append(lambda: _send(driver, plan, none, "none", rnd))  # noqa: B023
            if apc is not None:
                lanes.append(lambda: _send(driver, plan, apc, "apc", rnd))  # noqa: B023
            if connector:
                lanes.append(lambda: _connector_round(driver, plan, wanted, start, warm,
                                                      store.url, rnd, gap_s))  # noqa: B023  # fmt: skip
            k = (rnd - 1) % len(lanes)
            for lane in [*lanes[k:], *lanes[:k]]:
                lane()
                time.sleep(gap_s)
    return plan.runs


def _connector_round(driver: Driver, plan: Plan, wanted: set[str], start: Callable[..., VllmServer],
                     warm: Callable[[VllmServer, bool], None], url: str, rnd: int,
                     gap_s: float) -> None:  # fmt: skip
    """A fresh server on the store: the first round's first run stores the dataset
    (``kv_first``), then ``kv`` (its first run: prefixes from the store) and ``kv_reset`` (its
    prefix cache reset, the same dataset again)."""
    with start(f"vllm-kv-round{rnd}", transfer=connector_transfer(url)) as server:
        warm(server, True)
        if rnd == 1:
            _send(driver, plan, server, "kv_first", rnd)
            time.sleep(max(gap_s, 2.0))  # the last blocks are saved in the background
            server.reset_prefix_cache()
        if "kv" in wanted:
            _send(driver, plan, server, "kv", rnd)
            time.sleep(gap_s)
        if "kv_reset" in wanted:
            server.reset_prefix_cache()
            _send(driver, plan, server, "kv_reset", rnd)


def pooled(runs: Sequence[ClientRun], config: str) -> dict[str, float]:
    """A configuration's percentiles over its rounds: the median of the rounds' values (vLLM
    computes a run's percentiles; pooling its per-request values is not in its JSON for ITL)."""
    mine = [r.result.percentiles for r in runs if r.config == config]
    if not mine:
        return {}
    out = {}
    for key in mine[0]:
        values = sorted(p[key] for p in mine)
        mid = len(values) // 2
        out[key] = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return out


def same_texts(runs: Sequence[ClientRun], config: str, ref: str) -> tuple[int, int] | None:
    """Requests whose greedy output equals the reference's (same dataset, same order): equal,
    compared; None when either has no texts."""
    mine = [r.result.generated_texts for r in runs if r.config == config]
    theirs = [r.result.generated_texts for r in runs if r.config == ref]
    if not mine or not theirs or not theirs[0]:
        return None
    equal = compared = 0
    for texts in mine:
        for got, want in zip(texts, theirs[0], strict=False):
            compared += 1
            equal += got == want
    return equal, compared


def rows_of(runs: Sequence[ClientRun]) -> tuple[list[Row], list[list[str]]]:
    """DESIGN §9 rows (prefixed ``vllm/``) and the summary lines of vLLM's client."""
    rows: list[Row] = []
    stats = {c: pooled(runs, c) for c in dict.fromkeys(r.config for r in runs)}

    def row(case: str, key: str, mine: str, ref: str) -> None:
        if key in stats.get(mine, {}) and key in stats.get(ref, {}):
            rows.append(Row(f"vllm/{case}/{mine}", stats[mine][key], "ms", ref,
                            stats[ref][key]))  # fmt: skip

    for name in ("kv", "kv_reset"):
        row("ttft_p50", "ttft_p50", name, "none")
        row("ttft_p50", "ttft_p50", name, "apc")
        row("ttft_p99", "ttft_p99", name, "none")
        row("ttft_p99", "ttft_p99", name, "apc")
    for name in ("kv", "kv_reset"):
        mine = [r for r in runs if r.config == name]
        if not mine:
            continue
        apc = [r.hit_tokens for r in runs if r.config == "apc"]
        rows.append(Row(f"vllm/hit_tokens/{name}", sum(r.hit_tokens for r in mine) / len(mine),
                        "tokens", "apc" if apc else None, sum(apc) / len(apc) if apc else None,
                        "per run; apc: its own resident cache"))  # fmt: skip
        rows.append(Row(f"vllm/store_hit_tokens/{name}",
                        sum(r.store_hit_tokens for r in mine) / len(mine), "tokens",
                        note="per run: the prompt tokens the connector supplied"))  # fmt: skip
    lines = []
    for config, values in stats.items():
        mine = [r for r in runs if r.config == config]
        cells = ["vllm", config, str(len(mine)), str(sum(r.result.completed for r in mine))]
        cells += [_ms(values.get(f"{m}_p{q}")) for m in METRICS for q in PERCENTILES]
        cells += [f"{sum(r.hit_tokens for r in mine) // len(mine):,}",
                  f"{sum(r.store_hit_tokens for r in mine) // len(mine):,}"]  # fmt: skip
        lines.append(cells)
    return rows, lines


COLUMNS = ["client", "config", "runs", "reqs",
           *[f"{m} p{q}" for m in METRICS for q in PERCENTILES],
           "hits/run", "store/run"]  # fmt: skip


def _ms(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:,.0f}"


def summary(lines: list[list[str]]) -> Summary:
    return Summary("vLLM's client (its saved JSON; ms, median over rounds) beside ours "
                   "(all requests pooled)", COLUMNS, lines)  # fmt: skip
