from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kvoffload.bench.trace import workload
from kvoffload.bench.trace.workload import PROFILES, TraceShape, chain_keys, generate, read_jsonl
from kvoffload.client_sdk import block_keys
from kvoffload.errors import ConfigError


def test_profiles_bytes_per_token() -> None:
    assert PROFILES["smollm2-135m"].bytes_per_token == 23_040
    assert PROFILES["llama-3.1-8b"].bytes_per_token == 131_072
    # 70B with TP 8: 2 x 80 layers x (8 kv heads / 8 ranks) x 128 x 2 bytes, per rank
    seventy = PROFILES["llama-3.1-70b-tp8"]
    assert seventy.bytes_per_token == 40_960 == 2 * 80 * 1 * 128 * 2
    ns = seventy.namespace(16)
    assert ns.bytes_per_token == seventy.bytes_per_token and ns.tp_size == 8
    assert ns.block_bytes == 16 * 40_960


def test_generation_is_seeded_and_reproducible() -> None:
    shape = TraceShape(sessions=30)
    a, b, c = generate(shape, seed=7), generate(shape, seed=7), generate(shape, seed=8)
    assert len(a.requests) == len(b.requests)
    for x, y in zip(a.requests, b.requests, strict=True):
        assert (x.conversation, x.turn, x.arrival, x.output_tokens) == (
            y.conversation, y.turn, y.arrival, y.output_tokens,
        )  # fmt: skip
        assert np.array_equal(x.tokens, y.tokens)
    assert [r.prompt_tokens for r in a.requests] != [r.prompt_tokens for r in c.requests]


def test_distribution_bounds_of_the_default_shape() -> None:
    shape = TraceShape()
    trace = generate(shape, seed=3)
    reqs = trace.requests
    assert all(shape.output_tokens[0] <= r.output_tokens <= shape.output_tokens[1] for r in reqs)
    turns = Counter(r.conversation for r in reqs)
    kinds = {r.conversation: r.kind for r in reqs}
    chat = [n for conv, n in turns.items() if kinds[conv] == "chat"]
    docqa = [n for conv, n in turns.items() if kinds[conv] == "docqa"]
    assert chat and docqa and len(turns) == shape.sessions
    assert all(2 <= n <= 28 for n in chat) and max(chat) > 20 and min(chat) < 5
    assert all(1 <= n <= 4 for n in docqa)
    summary = trace.summary()
    # the published shape: mean prompt about 2,200 tokens
    assert 1_900 <= summary["prompt_tokens_mean"] <= 2_700
    assert 130 <= summary["output_tokens_mean"] <= 200
    # arrivals in order, sessions interleaved (not one after the other)
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals)
    first_conv = reqs[0].conversation
    positions = [i for i, r in enumerate(reqs) if r.conversation == first_conv]
    assert positions[-1] - positions[0] + 1 > len(positions)
    # a few shared heads: system prompts and documents
    assert {r.prefix for r in reqs} <= {f"system-{i}" for i in range(shape.system_prompts)} | {
        f"document-{i}" for i in range(shape.documents)
    }


def test_each_turn_extends_the_previous_prompt() -> None:
    trace = generate(TraceShape(sessions=10), seed=1)
    last: dict[str, np.ndarray] = {}
    for r in trace.requests:
        prev = last.get(r.conversation)
        if prev is not None:
            # history: the previous prompt, its reply, then the new user message
            assert r.prompt_tokens > prev.size
            assert np.array_equal(r.tokens[: prev.size], prev)
        last[r.conversation] = r.tokens
    heads: dict[str, np.ndarray] = {}
    for r in trace.requests:
        head = heads.setdefault(r.prefix, r.tokens[: r.prefix_tokens])
        assert r.prefix_tokens == head.size > 0
        assert np.array_equal(r.tokens[: r.prefix_tokens], head)  # shared across sessions
    assert len({r.conversation for r in trace.requests}) > len(heads)


def test_shape_validation() -> None:
    with pytest.raises(ConfigError):
        TraceShape(turns=(5, 2))
    with pytest.raises(ConfigError):
        TraceShape(docqa_fraction=1.5)
    with pytest.raises(ConfigError):
        TraceShape(sessions=0)


def test_chain_keys_match_fresh_block_keys() -> None:
    trace = generate(TraceShape(sessions=8), seed=2)
    ns = PROFILES["smollm2-135m"].namespace(16)
    chains = chain_keys(trace.requests, ns)
    for r, chain in zip(trace.requests, chains, strict=True):
        assert chain == block_keys(ns, r.tokens)
        assert len(chain) == r.prompt_tokens // 16


@pytest.mark.parametrize("ids", [False, True])
def test_jsonl_round_trip(tmp_path: Path, ids: bool) -> None:
    trace = generate(TraceShape(sessions=12), seed=5)
    path = tmp_path / "trace.jsonl"
    workload.write_jsonl(trace, path, ids=ids)
    back = read_jsonl(path, seed=5)
    assert len(back.requests) == len(trace.requests)
    for a, b in zip(trace.requests, back.requests, strict=True):
        assert (a.conversation, a.turn, a.output_tokens) == (
            b.conversation,
            b.turn,
            b.output_tokens,
        )
        assert np.array_equal(a.tokens, b.tokens)
    ns = PROFILES["llama-3.1-8b"].namespace(16)
    assert chain_keys(trace.requests, ns) == chain_keys(back.requests, ns)


def test_jsonl_counts_share_prefixes(tmp_path: Path) -> None:
    lines = [
        {
            "conversation": "a",
            "tokens": 40,
            "output_tokens": 5,
            "prefix": "sys",
            "prefix_tokens": 32,
        },
        {
            "conversation": "b",
            "tokens": 50,
            "output_tokens": 5,
            "prefix": "sys",
            "prefix_tokens": 32,
        },
        {"conversation": "a", "tokens": 3000, "output_tokens": 7},
        {"conversation": 7, "token_ids": [1, 2, 3], "output_tokens": 0, "arrival": 2.5},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    trace = read_jsonl(path)
    a0, b0, a1, c = trace.requests
    assert np.array_equal(a0.tokens[:32], b0.tokens[:32])  # the shared prefix
    assert not np.array_equal(a0.tokens[32:40], b0.tokens[32:40])
    assert np.array_equal(a1.tokens[:40], a0.tokens) and a1.turn == 1 and a1.prompt_tokens == 3000
    assert c.conversation == "7" and c.tokens.tolist() == [1, 2, 3] and c.arrival == 2.5


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 2: not JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"conversation": "a", "tokens": 5, "output_tokens": 1, "colour": 1}', "unknown field"),
        ('{"tokens": 5, "output_tokens": 1}', "conversation"),
        ('{"conversation": "a", "tokens": 5}', "output_tokens is required"),
        ('{"conversation": "a", "output_tokens": 1}', "exactly one of tokens or token_ids"),
        ('{"conversation": "a", "tokens": 5, "token_ids": [1], "output_tokens": 1}', "exactly one"),
        ('{"conversation": "a", "tokens": -5, "output_tokens": 1}', "non-negative integer"),
        ('{"conversation": "a", "tokens": 5, "output_tokens": true}', "output_tokens"),
        ('{"conversation": "a", "token_ids": [1, -2], "output_tokens": 1}', "token_ids"),
        ('{"conversation": "a", "tokens": 5, "output_tokens": 1, "arrival": "soon"}', "arrival"),
        (
            '{"conversation": "z", "tokens": 9, "output_tokens": 1, "prefix": "q", '
            '"prefix_tokens": 3}',
            "changes its prefix",
        ),
    ],  # fmt: skip
)
def test_bad_jsonl_lines_are_clear_errors(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    first = (
        '{"conversation": "z", "tokens": 4, "output_tokens": 1, "prefix": "p", "prefix_tokens": 2}'
    )
    path.write_text(first + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=message) as info:
        read_jsonl(path)
    assert "line 2" in str(info.value)


def test_empty_or_missing_trace_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="no requests"):
        read_jsonl(empty)
    with pytest.raises(ConfigError, match="cannot read trace"):
        read_jsonl(tmp_path / "missing.jsonl")
