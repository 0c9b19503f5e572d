"""`bench serve --client vllm` without vLLM: the custom dataset writer, the parsing of a result
file that ``vllm.benchmarks.serve`` really wrote, the rows and the flags.

The run against real servers is in tests/integration/engines/test_vllm_bench_client_serve.py
(`.ci/engines.sh vllm-cpu`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from kvoffload.bench.serve import vllm_client
from kvoffload.bench.serve.serve_bench import add_arguments, run_from_args, scaled_shape
from kvoffload.bench.serve.vllm_client import (
    ClientRun,
    PrefixRepetition,
    VllmResult,
    parse_result,
    rows_of,
    same_texts,
    write_custom_dataset,
)
from kvoffload.bench.trace.workload import generate
from kvoffload.errors import ConfigError

# Written by `vllm.benchmarks.serve` (vllm-cpu 0.32.0) with `--save-result --save-detailed
# --metric-percentiles 50,90,99` against a real SmolLM2 server, in the run committed under
# results/2026-12-05/ (the kv row of its first round).
RESULTS = Path(__file__).parents[4] / "results" / "2026-12-05" / "bench-serve-vllm"
SAVED = RESULTS / "vllm-kv-round1.json"


def _decode(ids: list[int] | tuple[int, ...]) -> str:
    return "".join(f"<{i}>" for i in ids)


def test_the_custom_dataset_keeps_every_session_turn_in_order(tmp_path: Path) -> None:
    trace = generate(scaled_shape(3), seed=2)
    path = tmp_path / "custom.jsonl"
    assert write_custom_dataset(trace.requests, path, _decode) == len(trace.requests)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(x["conversation"], x["turn"]) for x in lines] == [
        (r.conversation, r.turn) for r in trace.requests
    ]
    for line, request in zip(lines, trace.requests, strict=True):
        assert line["prompt"] == _decode([int(t) for t in request.tokens])
        assert line["output_tokens"] == request.output_tokens
    # A later turn's prompt starts with the text of the turn before (the history), so vLLM's
    # client sends prefixes a cache can reuse.
    by_turn = {(x["conversation"], x["turn"]): x["prompt"] for x in lines}
    later = [(c, t) for (c, t) in by_turn if t > 0]
    assert later
    for c, t in later:
        assert by_turn[(c, t)].startswith(by_turn[(c, t - 1)])


def test_a_trace_without_token_ids_is_refused(tmp_path: Path) -> None:
    trace = generate(scaled_shape(1), seed=0)
    request = dataclasses.replace(trace.requests[0], tokens=trace.requests[0].tokens[:0])
    with pytest.raises(ConfigError, match="no token ids"):
        write_custom_dataset([request], tmp_path / "x.jsonl", _decode)


def test_a_result_vllm_saved_is_read() -> None:
    result = parse_result(SAVED)
    raw = json.loads(SAVED.read_text())
    assert result.completed == raw["completed"] == 12 and result.failed == 0
    for metric in ("ttft", "tpot", "itl"):
        for q in (50, 90, 99):
            assert result.percentiles[f"{metric}_p{q}"] == raw[f"p{q}_{metric}_ms"]
        assert result.percentiles[f"{metric}_p50"] <= result.percentiles[f"{metric}_p99"]
    assert len(result.generated_texts) == 12 and all(result.generated_texts)
    assert all(n > 1536 for n in result.input_lens)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("not json", "not a vLLM result"),
        ("[1, 2]", "not a vLLM result"),
        ('{"completed": 1}', "no p50_ttft_ms"),
    ],
)
def test_a_file_that_is_not_a_result_is_a_config_error(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why):
        parse_result(path)
    with pytest.raises(ConfigError, match="not a vLLM result"):
        parse_result(tmp_path / "missing.json")


def test_a_result_without_counts_is_a_config_error(tmp_path: Path) -> None:
    raw = json.loads(SAVED.read_text())
    del raw["completed"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="no request counts"):
        parse_result(path)


def _run(config: str, rnd: int, ttft_p50: float, texts: tuple[str, ...] = ("a", "b"),
         store: int = 0) -> ClientRun:  # fmt: skip
    values = {f"{m}_p{q}": ttft_p50 * q / 50 for m in ("ttft", "tpot", "itl") for q in (50, 90, 99)}
    result = VllmResult(Path(f"vllm-{config}-round{rnd}.json"), 2, 0, values, texts)
    return ClientRun(config, rnd, result, hit_tokens=store + 100, store_hit_tokens=store)


def test_rows_take_the_median_of_the_rounds_against_none_and_apc() -> None:
    runs = [
        _run("none", 1, 3000.0), _run("none", 2, 4000.0), _run("none", 3, 3500.0),
        _run("apc", 1, 150.0), _run("apc", 2, 200.0), _run("apc", 3, 170.0),
        _run("kv", 1, 300.0, store=1536), _run("kv", 2, 200.0, store=1536),
        _run("kv", 3, 250.0, store=1536),
    ]  # fmt: skip
    rows, lines = rows_of(runs)
    by_case = {(r.case, r.ref): r for r in rows}
    p50 = by_case[("vllm/ttft_p50/kv", "none")]
    assert (p50.value, p50.ref_value) == (250.0, 3500.0)
    assert by_case[("vllm/ttft_p50/kv", "apc")].ref_value == 170.0
    assert by_case[("vllm/ttft_p99/kv", "none")].value == 250.0 * 99 / 50
    assert by_case[("vllm/store_hit_tokens/kv", None)].value == 1536
    hits = by_case[("vllm/hit_tokens/kv", "apc")]
    assert (hits.value, hits.ref_value) == (1636, 100)
    assert [line[1] for line in lines] == ["none", "apc", "kv"]
    assert all(len(line) == len(vllm_client.COLUMNS) for line in lines)
    assert lines[2][1:4] == ["kv", "3", "6"] and lines[2][-2:] == ["1,636", "1,536"]


def test_greedy_outputs_are_compared_request_by_request() -> None:
    runs = [_run("none", 1, 1.0, ("x", "y")), _run("kv", 1, 1.0, ("x", "z")),
            _run("kv", 2, 1.0, ("x", "y"))]  # fmt: skip
    assert same_texts(runs, "kv", "none") == (3, 4)
    assert same_texts(runs, "kv_reset", "none") is None


def test_the_prefix_repetition_flags_name_vllm_s_arguments() -> None:
    argv = PrefixRepetition(1536, 64, 4, 3).argv(8)
    pairs = dict(zip(argv[::2], argv[1::2], strict=True))
    assert pairs == {
        "--dataset-name": "prefix_repetition",
        "--num-prompts": "12",
        "--prefix-repetition-prefix-len": "1536",
        "--prefix-repetition-suffix-len": "64",
        "--prefix-repetition-num-prefixes": "4",
        "--prefix-repetition-output-len": "8",
    }


def test_bad_vllm_client_arguments_are_config_errors(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = ["--client", "vllm", "--model-dir", str(model), "--dir", str(tmp_path)]
    with pytest.raises(ConfigError, match="bad --configs"):
        run_from_args(parser.parse_args([*base, "--configs", "kv_ssd"]))
    with pytest.raises(ConfigError, match="bad --our-configs"):
        run_from_args(parser.parse_args([*base, "--configs", "kv", "--our-configs", "gpu"]))
    with pytest.raises(ConfigError, match="at least 1"):
        run_from_args(parser.parse_args([*base, "--configs", "kv", "--rounds", "0"]))
