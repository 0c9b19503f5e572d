"""Workloads for `kvoffload bench trace`: model profiles, a seeded multi-turn trace generator and
a JSONL trace format.

The synthetic trace is shaped like the published FusIOnX / Dynamo multi-turn benchmark (vLLM's
`benchmarks/multi_turn`): chat sessions of 2-28 turns whose prompts carry the whole history
(mean prompt ~2,200 tokens), 100-230 output tokens per turn, a few system prompts shared across
sessions, Poisson session arrivals and interleaved sessions; plus a document-QA mix (long shared
documents, short questions). Token ids are random: only prefix structure matters to a cache.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvoffload.client_sdk import BlockKey, Namespace, block_keys, engine_hashes
from kvoffload.compression import DTYPE_BYTES
from kvoffload.errors import ConfigError

__all__ = [
    "PROFILES",
    "ModelProfile",
    "Request",
    "Trace",
    "TraceShape",
    "chain_keys",
    "generate",
    "read_jsonl",
    "write_jsonl",
]

TokenIds = npt.NDArray[np.uint32]


@dataclass(frozen=True)
class ModelProfile:
    """What a model's KV cache costs per token on one tensor-parallel rank, and what its
    prefill costs (for the TTFT model)."""

    name: str
    model: str
    num_layers: int
    num_kv_heads: int  # of the whole model; each TP rank holds num_kv_heads / tp_size
    head_size: int
    hidden_size: int
    params: float
    dtype: str = "bfloat16"
    tp_size: int = 1

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv heads per rank x head size x dtype bytes."""
        return (
            2 * self.num_layers * self.kv_heads_per_rank * self.head_size * DTYPE_BYTES[self.dtype]
        )

    def namespace(self, block_tokens: int, salt: str = "") -> Namespace:
        return Namespace(
            self.model,
            dtype=self.dtype,
            block_tokens=block_tokens,
            num_layers=self.num_layers,
            num_kv_heads=self.kv_heads_per_rank,
            head_size=self.head_size,
            tp_size=self.tp_size,
            salt=salt,
        )


PROFILES: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        # 2 x 30 x 3 x 64 x 2 B = 23,040 B/token
        ModelProfile("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", 30, 3, 64, 576, 1.35e8),
        # 2 x 32 x 8 x 128 x 2 B = 131,072 B/token
        ModelProfile("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 32, 8, 128, 4096, 8.03e9),
        # per rank with TP 8: 2 x 80 x (8 / 8) x 128 x 2 B = 40,960 B/token (327,680 B/token in all)
        ModelProfile(
            "llama-3.1-70b-tp8",
            "meta-llama/Llama-3.1-70B-Instruct",
            80,
            8,
            128,
            8192,
            7.06e10,
            tp_size=8,
        ),
    )
}


@dataclass(frozen=True, eq=False)
class Request:
    """One request of a trace: the whole prompt (history included) and its output length."""

    conversation: str
    turn: int  # 0-based within its conversation
    arrival: float  # seconds from the start of the trace
    tokens: TokenIds
    output_tokens: int
    kind: str = "chat"  # "chat", "docqa" or "file"
    # The shared head of the prompt (a system prompt or a document) and its length.
    prefix: str = ""
    prefix_tokens: int = 0
    # A trace that names its blocks (Mooncake's hash ids) instead of giving tokens: one id per
    # block, and the prompt's length in tokens (`tokens` is then empty).
    block_ids: tuple[int, ...] = ()
    length: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.length if self.block_ids else int(self.tokens.size)


@dataclass(frozen=True)
class TraceShape:
    """Parameters of the synthetic trace; ranges are inclusive and drawn uniformly unless noted."""

    sessions: int = 200
    # Share of sessions that are document QA instead of chat.
    docqa_fraction: float = 0.2
    # Chat turns per session, uniform in this range (the published benchmark's 2-28).
    turns: tuple[int, int] = (2, 28)
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (100, 400)
    # The first user message (lognormal, this mean, clipped to 16..4000 tokens).
    first_message_mean: float = 100.0
    user_tokens: tuple[int, int] = (10, 60)
    output_tokens: tuple[int, int] = (100, 230)
    documents: int = 6
    document_tokens: tuple[int, int] = (2000, 5000)
    questions: tuple[int, int] = (1, 4)
    question_tokens: tuple[int, int] = (15, 60)
    # Sessions arrive as a Poisson process (per second); a user answers a reply after an
    # exponential think time; a reply takes output tokens x tpot.
    arrival_rate: float = 1.0
    think_time_s: float = 60.0
    tpot_s: float = 0.025
    vocab: int = 32_000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple) and not 0 <= value[0] <= value[1]:
                raise ConfigError(f"trace shape {f.name} must be a range lo <= hi, got {value}")
        if self.sessions < 1 or self.system_prompts < 1 or self.documents < 1:
            raise ConfigError("a trace needs at least one session, system prompt and document")
        if self.turns[0] < 1:
            raise ConfigError("chat sessions need at least one turn")
        if not 0.0 <= self.docqa_fraction <= 1.0:
            raise ConfigError(f"docqa_fraction must be in [0, 1], got {self.docqa_fraction}")
        if self.arrival_rate <= 0 or self.think_time_s < 0:
            raise ConfigError("arrival_rate must be positive and think_time_s non-negative")


@dataclass
class Trace:
    requests: list[Request]
    source: str  # "generated (seed N)" or the JSONL path
    shape: dict[str, object] = field(default_factory=dict)
    # Tokens per block when the trace names its blocks (its requests' `block_ids`); 0: tokens.
    block_tokens: int = 0

    def summary(self) -> dict[str, float]:
        prompts = np.array([r.prompt_tokens for r in self.requests], dtype=np.float64)
        outputs = np.array([r.output_tokens for r in self.requests], dtype=np.float64)
        turns: dict[str, int] = {}
        for r in self.requests:
            turns[r.conversation] = turns.get(r.conversation, 0) + 1
        per_conv = np.array(list(turns.values()), dtype=np.float64)
        return {
            "requests": float(len(self.requests)),
            "conversations": float(len(turns)),
            "prompt_tokens_mean": float(prompts.mean()) if prompts.size else 0.0,
            "prompt_tokens_p50": float(np.median(prompts)) if prompts.size else 0.0,
            "prompt_tokens_max": float(prompts.max()) if prompts.size else 0.0,
            "output_tokens_mean": float(outputs.mean()) if outputs.size else 0.0,
            "turns_mean": float(per_conv.mean()) if per_conv.size else 0.0,
            "prompt_tokens_total": float(prompts.sum()),
        }


def _stream(seed: int, name: str, n: int, vocab: int) -> TokenIds:
    """`n` token ids that depend only on (seed, name): the same in every process."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.integers(0, vocab, size=n, dtype=np.uint32)


def _span(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    return int(rng.integers(lo_hi[0], lo_hi[1], endpoint=True))


def _chat(rng: np.random.Generator, shape: TraceShape) -> list[list[int]]:
    """Per turn: [new user tokens, output tokens]; the first turn's user part includes the
    system prompt (as a negative marker: -(index + 1), resolved by the caller)."""
    n_turns = _span(rng, shape.turns)
    # System prompts are not equally popular: weight 1/(i + 1).
    weights = 1.0 / np.arange(1, shape.system_prompts + 1)
    system = int(rng.choice(shape.system_prompts, p=weights / weights.sum()))
    sigma = 0.8
    first = float(rng.lognormal(np.log(shape.first_message_mean) - sigma**2 / 2, sigma))
    turns = [[-(system + 1), int(np.clip(first, 16, 4000)), _span(rng, shape.output_tokens)]]
    for _ in range(n_turns - 1):
        turns.append([_span(rng, shape.user_tokens), _span(rng, shape.output_tokens)])
    return turns


def generate(shape: TraceShape | None = None, seed: int = 0) -> Trace:
    """A reproducible synthetic trace: the same (shape, seed) gives the same requests."""
    shape = shape or TraceShape()
    rng = np.random.default_rng(seed)
    heads = {
        f"system-{i}": _stream(
            seed, f"shared/system-{i}", _span(rng, shape.system_tokens), shape.vocab
        )
        for i in range(shape.system_prompts)
    }
    heads.update(
        (
            f"document-{i}",
            _stream(seed, f"shared/document-{i}", _span(rng, shape.document_tokens), shape.vocab),
        )
        for i in range(shape.documents)
    )
    requests: list[Request] = []
    start = 0.0
    for s in range(shape.sessions):
        start += float(rng.exponential(1.0 / shape.arrival_rate))
        docqa = bool(rng.random() < shape.docqa_fraction)
        name = f"{'doc' if docqa else 'chat'}-{s:05d}"
        if docqa:
            prefix = f"document-{int(rng.integers(shape.documents))}"
            parts = [
                [_span(rng, shape.question_tokens), _span(rng, shape.output_tokens)]
                for _ in range(_span(rng, shape.questions))
            ]
        else:
            turns = _chat(rng, shape)
            prefix = f"system-{-turns[0][0] - 1}"
            parts = [turns[0][1:], *turns[1:]]
        head = heads[prefix]
        # The session's private tokens (user messages and replies) in one stream.
        private = _stream(seed, f"conversation/{name}", sum(sum(p) for p in parts), shape.vocab)
        sequence = np.concatenate([head, private])
        at, pos = start, head.size
        for turn, (user, output) in enumerate(parts):
            pos += user
            kind = "docqa" if docqa else "chat"
            requests.append(
                Request(name, turn, at, sequence[:pos], output, kind, prefix, head.size)
            )
            pos += output
            at += output * shape.tpot_s + float(rng.exponential(shape.think_time_s))
    requests.sort(key=lambda r: (r.arrival, r.conversation, r.turn))
    return Trace(requests, f"generated (seed {seed})", asdict(shape))


def chain_keys(requests: Sequence[Request], namespace: Namespace) -> list[list[BlockKey]]:
    """The chained keys of every full block of each request's prompt (for a trace that names
    its blocks, one key per block id, the namespace's `hash_algo` naming the ids).

    Keys of a conversation's earlier prompt are reused when the new prompt extends it, so a
    trace hashes each distinct block about once.
    """
    bt = namespace.block_tokens
    seen: dict[str, tuple[TokenIds, list[BlockKey]]] = {}
    out: list[list[BlockKey]] = []
    named: dict[int, BlockKey] = {}  # block id -> key, for traces that name their blocks
    for r in requests:
        if r.block_ids:
            missing = [i for i in dict.fromkeys(r.block_ids) if i not in named]
            digests = engine_hashes(namespace, [i.to_bytes(8, "little") for i in missing])
            named.update((i, BlockKey(d[:16])) for i, d in zip(missing, digests, strict=True))
            out.append([named[i] for i in r.block_ids])
            continue
        n = r.prompt_tokens // bt
        reuse = 0
        prev = seen.get(r.conversation)
        if prev is not None:
            tokens, keys = prev
            m = min(len(keys), n)
            diff = np.flatnonzero(tokens[: m * bt] != r.tokens[: m * bt])
            reuse = m if diff.size == 0 else int(diff[0]) // bt
        else:
            keys = []
        parent = keys[reuse - 1] if reuse else None
        chain = keys[:reuse] + block_keys(namespace, r.tokens[reuse * bt : n * bt], parent)
        if prev is None or len(chain) >= len(prev[1]):
            seen[r.conversation] = (r.tokens, chain)
        out.append(chain)
    return out


# ---------------------------------------------------------------------------------- JSONL

_FIELDS = ("conversation", "tokens", "token_ids", "output_tokens", "arrival", "kind", "prefix",
           "prefix_tokens")  # fmt: skip


def _int(value: object, what: str, line: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"trace line {line}: {what} must be a non-negative integer, got {value!r}"
        )
    return value


def _records(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, object]]]:
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"trace line {number}: not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"trace line {number}: expected a JSON object, got {text.strip()!r}")
        unknown = sorted(set(record) - set(_FIELDS))
        if unknown:
            raise ConfigError(
                f"trace line {number}: unknown field(s) {unknown}; known: {', '.join(_FIELDS)}"
            )
        yield number, record


@dataclass
class _Stream:
    """A conversation's token stream when a trace gives counts only."""

    prefix: str
    prefix_tokens: int
    tokens: TokenIds


class _Reader:
    def __init__(self, seed: int, vocab: int) -> None:
        self.seed, self.vocab = seed, vocab
        self.turns: dict[str, int] = {}
        self.streams: dict[str, _Stream] = {}

    def request(self, number: int, rec: dict[str, object]) -> Request:
        conv = rec.get("conversation")
        if isinstance(conv, bool) or not isinstance(conv, (str, int)) or conv == "":
            raise ConfigError(f"trace line {number}: conversation (string or integer) is required")
        name = str(conv)
        if "output_tokens" not in rec:
            raise ConfigError(f"trace line {number}: output_tokens is required")
        output = _int(rec["output_tokens"], "output_tokens", number)
        arrival = rec.get("arrival", float(number))
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
            raise ConfigError(f"trace line {number}: arrival must be a number of seconds")
        kind = rec.get("kind", "file")
        prefix = rec.get("prefix", "")
        if not isinstance(kind, str) or not isinstance(prefix, str):
            raise ConfigError(f"trace line {number}: kind and prefix must be strings")
        prefix_tokens = _int(rec.get("prefix_tokens", 0), "prefix_tokens", number)
        if ("tokens" in rec) == ("token_ids" in rec):
            raise ConfigError(f"trace line {number}: give exactly one of tokens or token_ids")
        if "token_ids" in rec:
            ids = rec["token_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32 for i in ids
            ):
                raise ConfigError(f"trace line {number}: token_ids must be integers in [0, 2**32)")
            tokens: TokenIds = np.asarray(ids, dtype=np.uint32)
        else:
            count = _int(rec["tokens"], "tokens", number)
            tokens = self._stream(number, name, prefix, prefix_tokens, count)[:count]
        turn = self.turns.get(name, 0)
        self.turns[name] = turn + 1
        return Request(name, turn, float(arrival), tokens, output, kind, prefix, prefix_tokens)

    def _stream(
        self, line: int, name: str, prefix: str, prefix_tokens: int, count: int
    ) -> TokenIds:
        """At least `count` ids of the conversation's stream: its shared prefix (ids from the
        prefix name), then private ids from the conversation name; grown by doubling."""
        stream = self.streams.get(name)
        if stream is not None and (prefix, prefix_tokens) not in (
            ("", 0),
            (stream.prefix, stream.prefix_tokens),
        ):
            raise ConfigError(
                f"trace line {line}: conversation {name!r} changes its prefix from "
                f"{stream.prefix!r} ({stream.prefix_tokens} tokens) to {prefix!r} ({prefix_tokens})"
            )
        if stream is None:
            stream = _Stream(prefix, prefix_tokens, np.empty(0, dtype=np.uint32))
            self.streams[name] = stream
        if stream.tokens.size < count:
            size = 1 << (max(count, 1024) - 1).bit_length()
            head = _stream(self.seed, f"shared/{stream.prefix}", stream.prefix_tokens, self.vocab)
            private = _stream(self.seed, f"conversation/{name}", size, self.vocab)
            stream.tokens = np.concatenate([head, private])
        return stream.tokens


def read_jsonl(path: str | Path, *, seed: int = 0, vocab: int = 32_000) -> Trace:
    """Read a trace: one JSON object per line, one request each, in arrival order.

    Fields: ``conversation`` (string or integer, required); exactly one of ``tokens`` (the
    prompt's token count, history included) or ``token_ids`` (its ids); ``output_tokens``
    (required); optional ``arrival`` (seconds; default: the line number), ``kind``, and
    ``prefix`` with ``prefix_tokens`` (a head shared by every conversation naming the same
    prefix, e.g. a system prompt or a document).

    With counts only, a conversation's prompts are prefixes of one token stream (each turn
    extends the last, as a chat's history does), its ids derived from (seed, names) exactly as
    `generate` derives them, so a generated trace written with counts reads back identical.

    Raises:
        ConfigError: the file cannot be read, holds no request, or a line is malformed (the
            message names the line).
    """
    try:
        with open(path) as fh:
            lines = fh.readlines()
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from None
    reader = _Reader(seed, vocab)
    requests = [reader.request(number, rec) for number, rec in _records(lines)]
    if not requests:
        raise ConfigError(f"trace {path} holds no requests")
    return Trace(requests, str(path))


def write_jsonl(trace: Trace, path: str | Path, *, ids: bool = False) -> None:
    """Write `trace` so that `read_jsonl` reads the same prompts back.

    Without `ids` a line holds token counts and the shared prefix by name (compact; exact for
    generated traces read back with the same seed); with `ids`, the token ids themselves. A
    trace that names its blocks (Mooncake's) is written in its own format.
    """
    with open(path, "w") as fh:
        for r in trace.requests:
            if r.block_ids:  # a trace that names its blocks is written in Mooncake's format
                mooncake = {
                    "timestamp": round(r.arrival * 1e3),
                    "input_length": r.length,
                    "output_length": r.output_tokens,
                    "hash_ids": list(r.block_ids),
                }
                fh.write(json.dumps(mooncake) + "\n")
                continue
            record: dict[str, object] = {"conversation": r.conversation}
            if ids:
                record["token_ids"] = r.tokens.tolist()
            else:
                record["tokens"] = r.prompt_tokens
            record["output_tokens"] = r.output_tokens
            record["arrival"] = round(r.arrival, 6)
            record["kind"] = r.kind
            if r.prefix and not ids:
                record["prefix"] = r.prefix
                record["prefix_tokens"] = r.prefix_tokens
            fh.write(json.dumps(record, separators=(",", ":")) + "\n")
