"""Hugging Face transformers adapter: store a model's KV cache as blocks, rebuild it from them.

A block holds `block_tokens` consecutive tokens of every layer, laid out ``[layer][k/v][kv head]
[token][head dim]`` (the namespace layout "LKHTD"), so one `get_into` fills one block and a single
permute turns a run of blocks back into per-layer tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvoffload.client_sdk import Client, Namespace, block_keys

__all__ = [
    "CacheLoad",
    "TransformersKV",
    "blocks_to_kv",
    "cache_to_kv",
    "kv_to_blocks",
    "kv_to_cache",
    "namespace_for_model",
]


def namespace_for_model(
    model: Any, *, model_id: str, block_tokens: int = 16, revision: str = "", codec: str = ""
) -> Namespace:
    """The namespace of a transformers causal LM's KV cache on this process (TP size 1).

    `codec` names the namespace's codec (see `Namespace.codec`); a lossy one is part of the
    blocks' identity.
    """
    cfg = model.config
    heads = cfg.num_attention_heads
    head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return Namespace(
        model=model_id,
        revision=revision,
        dtype=str(model.dtype).removeprefix("torch."),
        block_tokens=block_tokens,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_size=head_size,
        layout="LKHTD",
        codec=codec,
    )


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [batch, kv heads, tokens, head dim]."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _make_cache(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(pairs)
    except TypeError:  # transformers < 4.56
        return DynamicCache.from_legacy_cache(tuple(pairs))


def cache_to_kv(cache: Any, span: slice = slice(None)) -> torch.Tensor:
    """Tokens `span` of a batch-1 cache as one ``[layer, k/v, kv head, token, dim]`` tensor."""
    return torch.stack([torch.stack((k[0, :, span], v[0, :, span])) for k, v in _layers(cache)])


def kv_to_cache(kv: torch.Tensor) -> Any:
    """A batch-1 `DynamicCache` over ``[layer, k/v, kv head, token, dim]`` values (views)."""
    return _make_cache(
        [(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0)) for layer in range(kv.shape[0])]
    )


def kv_to_blocks(kv: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """``[L, 2, H, T, D]`` -> ``[blocks, L, 2, H, block_tokens, D]``, each block contiguous
    (one copy); T must be a multiple of `block_tokens`."""
    n_blocks = kv.shape[3] // block_tokens
    return kv.unflatten(3, (n_blocks, block_tokens)).permute(3, 0, 1, 2, 4, 5).contiguous()


def blocks_to_kv(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of `kv_to_blocks`."""
    n_blocks, layers, _, heads, size, dim = blocks.shape
    return blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, n_blocks * size, dim)


@dataclass(frozen=True)
class CacheLoad:
    """A rebuilt cache for the first `tokens` tokens (None when nothing was found)."""

    cache: Any
    tokens: int
    bytes: int


class TransformersKV:
    """Moves a transformers `DynamicCache` (batch size 1) to and from a kvoffload store."""

    def __init__(self, client: Client, namespace: Namespace) -> None:
        self.client = client
        self.namespace = namespace
        self._dtype = getattr(torch, namespace.dtype)
        ns = namespace
        self._block_shape = (ns.num_layers, 2, ns.num_kv_heads, ns.block_tokens, ns.head_size)
        self._block_buffer = torch.zeros(self._block_shape, dtype=self._dtype)

    def store(self, token_ids: Sequence[int], cache: Any) -> tuple[int, int]:
        """Store every full block of `token_ids` that the cache covers and the store lacks.

        Returns:
            (blocks written, bytes written).
        """
        size = self.namespace.block_tokens
        n_blocks = min(len(token_ids), _layers(cache)[0][0].shape[2]) // size
        keys = block_keys(self.namespace, list(token_ids[: n_blocks * size]))
        first = self.client.lookup(keys)
        if first >= n_blocks:
            return 0, 0
        span = slice(first * size, n_blocks * size)
        # [L, 2, H, T, D] -> [blocks, L, 2, H, B, D]: one copy, then each block is contiguous.
        blocks = kv_to_blocks(cache_to_kv(cache, span), size)
        n_new = n_blocks - first
        for i in range(n_new):
            index = first + i
            parent = keys[index - 1] if index else None
            self.client.put(keys[index], blocks[i], parent=parent)
        return n_new, n_new * self.namespace.block_bytes

    def load(self, token_ids: Sequence[int]) -> CacheLoad:
        """Rebuild the cache of the longest stored block prefix of `token_ids`.

        At least one token is always left for the model to compute, since it needs the logits
        of the last prompt token. A block that fails verification ends the prefix there.
        """
        size = self.namespace.block_tokens
        usable = (len(token_ids) - 1) // size
        keys = block_keys(self.namespace, list(token_ids[: usable * size]))
        hit = self.client.lookup(keys)
        if hit == 0:
            return CacheLoad(None, 0, 0)
        layers, _, heads, _, dim = self._block_shape
        kv = torch.empty((layers, 2, heads, hit * size, dim), dtype=self._dtype)
        # One reused block buffer stays hot in cache: each block is read from the store once
        # and scattered straight into the per-layer tensors, with no full-size staging copy.
        block = self._block_buffer
        for i in range(hit):
            if self.client.get_into(keys[i], block) is None:
                hit = i  # evicted or corrupt since lookup: recompute from here on
                kv = kv[:, :, :, : hit * size].contiguous()
                break
            kv[:, :, :, i * size : (i + 1) * size] = block
        if hit == 0:
            return CacheLoad(None, 0, 0)
        return CacheLoad(kv_to_cache(kv), hit * size, hit * self.namespace.block_bytes)
