"""`bench serve` without vLLM: the scaled trace, the rows, the plot, metric and error parsing.

The replay against real servers runs in `.venv-vllm-cpu` (tests/integration/engines)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvoffload.bench.registry import BENCHES
from kvoffload.bench.serve.plot import ttft_per_turn_plot
from kvoffload.bench.serve.serve_bench import (
    BLOCK_TOKENS,
    MODELS,
    ConfigRun,
    Sample,
    _first_error,
    add_arguments,
    hybrid_block_bytes,
    hybrid_block_tokens,
    hybrid_state_bytes,
    result_of,
    run_from_args,
    scaled_shape,
    working_set_blocks,
)
from kvoffload.bench.serve.servers import (
    DUMMY_WEIGHTS,
    HYBRID_ARGS,
    PINNED_ENV,
    QWEN3_NEXT_SMALL,
    TINY_QWEN3_NEXT,
    VllmServer,
    connector_transfer,
    parse_metrics,
    write_tiny_qwen3_next,
)
from kvoffload.bench.trace.workload import generate
from kvoffload.errors import ConfigError


def _run(name: str, ttfts: dict[int, list[float]], hits: int = 0) -> ConfigRun:
    run = ConfigRun(name, wall_s=float(sum(len(v) for v in ttfts.values())))
    for turn, values in ttfts.items():
        for i, ttft in enumerate(values):
            run.samples.append(Sample(f"c{i}", turn, 1000, ttft, ttft + 0.1, hits))
    return run


def test_the_scaled_trace_fits_the_served_model() -> None:
    trace = generate(scaled_shape(8), seed=0)
    assert max(r.prompt_tokens for r in trace.requests) < 8192 - 64  # --max-model-len 8192
    assert max(int(r.tokens.max()) for r in trace.requests) < 49_152  # SmolLM2's vocabulary
    assert {r.turn for r in trace.requests} >= {0, 1}


def test_the_working_set_counts_each_shared_block_once() -> None:
    trace = generate(scaled_shape(4), seed=1)
    blocks = working_set_blocks(trace.requests)
    per_request = sum(r.prompt_tokens // BLOCK_TOKENS for r in trace.requests)
    # Later turns repeat earlier prompts: far fewer distinct blocks than blocks sent.
    assert 0 < blocks < per_request
    assert working_set_blocks(trace.requests[:1]) == trace.requests[0].prompt_tokens // 128


def test_rows_compare_turns_after_the_first_with_the_references() -> None:
    runs = {
        "none": _run("none", {0: [2.0, 2.0], 1: [3.0, 3.0, 3.0]}),
        "apc": _run("apc", {0: [2.0], 1: [0.5, 0.5]}, hits=900),
        "vllm_offloading": ConfigRun("vllm_offloading", error="only on GPUs"),
        "kv": _run("kv", {0: [2.0, 2.0], 1: [0.6, 0.6, 0.6]}, hits=800),
        "kv_reset": _run("kv_reset", {0: [2.0], 1: [1.0, 1.0]}, hits=800),
    }
    result = result_of(runs, {"model": "test"})
    rows = {(r.case, r.ref): r for r in result.rows}
    kv = rows[("ttft_p50/turn2plus/kv", "none")]
    assert (kv.value, kv.ref_value, kv.unit) == (600.0, 3000.0, "ms")
    assert kv.ratio == pytest.approx(5.0)
    offloading = rows[("ttft_p50/turn2plus/kv_reset", "vllm_offloading")]
    assert offloading.ref_value is None and "only on GPUs" in offloading.note
    assert rows[("ttft_p50/turn2plus/kv_reset", "apc")].ratio == pytest.approx(0.5)
    assert rows[("hit_tokens/kv", "apc")].value == 800 * 5
    # A configuration that did not run gives no rows of its own.
    assert not any(case.endswith("/kv_ssd") for case, _ in rows)
    assert result.summary is not None and len(result.summary.lines) == len(runs)
    assert "vllm_offloading: only on GPUs" in result.notes


def test_the_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runs = {"none": _run("none", {0: [2.0], 1: [3.0]}).samples, "kv": []}
    assert ttft_per_turn_plot(runs, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_metrics_are_summed_over_labels() -> None:
    text = (
        "# HELP x y\n"
        'vllm:prefix_cache_hits_total{engine="0"} 3.0\n'
        'vllm:prefix_cache_hits_total{engine="1"} 4.0\n'
        "kvoffload_engine_hits_total 7\n"
        "not a number here\n"
    )
    assert parse_metrics(text) == {
        "vllm:prefix_cache_hits_total": 7.0,
        "kvoffload_engine_hits_total": 7.0,
    }


def test_a_server_that_failed_is_explained_by_its_root_cause(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(
        "ERROR RuntimeError: Worker failed with error 'CPU Offloading is currently only "
        "supported on CUDA-alike and XPU GPUs', please check the stack trace above\n"
        "RuntimeError: Engine core initialization failed.\n"
    )
    assert _first_error(log, "exited") == (
        "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
    )
    assert _first_error(tmp_path / "missing.log", "vLLM exited (1)") == "vLLM exited (1)"


def test_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    assert BENCHES["serve"] == "kvoffload.bench.serve.serve_bench"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="bad --configs"):
        run_from_args(parser.parse_args(["--configs", "none,gpu"]))
    with pytest.raises(ConfigError, match="no model"):
        run_from_args(parser.parse_args(["--model-dir", str(tmp_path)]))


def test_the_connector_flag_names_the_module_and_the_store() -> None:
    transfer = connector_transfer("kv://127.0.0.1:1", salt="s")
    assert transfer["kv_connector_module_path"] == "kvoffload.connectors.vllm"
    assert transfer["kv_connector_extra_config"] == {"url": "kv://127.0.0.1:1", "salt": "s"}


def test_a_reference_counts_only_the_requests_interleaved_with_the_row_s_configuration() -> None:
    none = _run("none", {1: [3.0, 3.0]})
    for sample in none.samples:
        sample.phase = "kv"
    none.samples += [Sample("c9", 1, 1000, 9.0, 9.1, 0, "kv_reset") for _ in range(3)]
    kv = _run("kv", {1: [1.0]})
    kv.samples[0].phase = "kv"
    ssd = _run("kv_ssd", {1: [1.0]})  # no none request ran in its phase: all of them count
    result = result_of({"none": none, "kv": kv, "kv_reset": _run("kv_reset", {1: [1.0]}),
                        "kv_ssd": ssd}, {})  # fmt: skip
    rows = {(r.case, r.ref): r for r in result.rows}
    assert rows[("ttft_p50/turn2plus/kv", "none")].ref_value == 3000.0
    assert rows[("ttft_p50/turn2plus/kv_reset", "none")].ref_value == 9000.0
    assert rows[("ttft_p50/turn2plus/kv_ssd", "none")].ref_value == 9000.0  # p50 of all 5
    assert rows[("throughput/kv", "none")].ref_value == pytest.approx(1 / 3.1)


def test_a_server_started_without_waiting_reports_its_exit_when_waited_for(tmp_path: Path) -> None:
    # /bin/false stands in for a vLLM that exits at once (`false -m vllm...` exits 1).
    with pytest.raises(RuntimeError, match=r"vLLM exited \(1\)"):
        VllmServer("/bin/false", tmp_path, tmp_path / "waited.log", timeout=60)
    server = VllmServer("/bin/false", tmp_path, tmp_path / "later.log", timeout=60, wait=False)
    with server:
        with pytest.raises(RuntimeError, match=r"vLLM exited \(1\)"):
            server.ready()
        # A request waits for it too, and fails the same way.
        with pytest.raises(RuntimeError, match=r"vLLM exited \(1\)"):
            server.complete([1, 2, 3], 1)
    assert server.proc.poll() == 1


def test_the_small_hybrid_keeps_qwen3_next_s_layout_in_384_token_blocks_of_3_mib(
    tmp_path: Path,
) -> None:
    small = MODELS["qwen3-next-small"]
    layers = QWEN3_NEXT_SMALL["layer_types"]
    assert isinstance(layers, list) and len(layers) == QWEN3_NEXT_SMALL["num_hidden_layers"] == 8
    # The real Qwen3-Next's 3:1: three gated delta-net layers, then one gated attention layer.
    assert layers == ["linear_attention"] * 3 + ["full_attention"] + layers[:4]
    # The state vLLM logged for it: 268,288 B, padded by 46.56% to a 384-token page of 2 KV
    # heads of 128 (393,216 B); 256 tokens' page would not hold it.
    assert hybrid_state_bytes(QWEN3_NEXT_SMALL) == 268_288
    assert 256 * 1024 < 268_288 <= 384 * 1024
    assert small.block_tokens == hybrid_block_tokens(QWEN3_NEXT_SMALL) == 384
    assert small.block_bytes == hybrid_block_bytes(QWEN3_NEXT_SMALL) == 8 * 393_216
    # The tiny one is unchanged: 384-token blocks, 4 pages of 98,304 B.
    tiny = MODELS["tiny-qwen3-next"]
    assert (tiny.block_tokens, tiny.block_bytes) == (384, 4 * 98_304)
    assert hybrid_state_bytes(TINY_QWEN3_NEXT) == 68_608
    for served in (small, tiny):
        assert served.args == (*DUMMY_WEIGHTS, *HYBRID_ARGS)
        assert dict(served.env) == PINNED_ENV
        assert served.vocab == QWEN3_NEXT_SMALL["vocab_size"] == 4096
    # `--model qwen3-next-small` serves that config.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "qwen3-next-small"]).model == "qwen3-next-small"
    folder = write_tiny_qwen3_next(tmp_path / "m", config=QWEN3_NEXT_SMALL)
    assert json.loads((folder / "config.json").read_text()) == QWEN3_NEXT_SMALL
    with pytest.raises(ConfigError, match="head_dim"):
        hybrid_block_tokens({**QWEN3_NEXT_SMALL, "head_dim": None})
