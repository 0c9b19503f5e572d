"""vLLM's paged KV cache seen as whole blocks: gather a block's pages from every layer into one
contiguous buffer, scatter such a buffer back.

vLLM 0.33.0 hands a connector one 4-D view per layer with the logical shape ``[B, H, N, C]``
(blocks, KV heads, tokens, K and V concatenated) over one flat buffer, in a physical order
chosen at start-up: layer-compact (``LBNHC``, ``LBHNC``) or cross-layer (``BLNHC`` ...), and
with attention kernels that use smaller blocks than the scheduler, a manager block made of
several kernel blocks. Whatever the physical order, a stored block has one canonical byte
order, ``[layer][token][head][C]`` (namespace layout ``vllm:LNHC``): blocks written by a
layer-compact engine load into a cross-layer one and back.

This module needs torch only, so it is tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvoffload.errors import ConfigError

__all__ = ["CANONICAL_LAYOUT", "PagedKV"]

CANONICAL_LAYOUT = "vllm:LNHC"


def _bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8, so every KV dtype (fp8 included) moves as plain bytes."""
    if tensor.dim() != 4:
        raise ConfigError(f"expected a [blocks, heads, tokens, C] KV view, got {tensor.shape}")
    if tensor.stride(-1) != 1:
        raise ConfigError("the last dimension of a KV view must be contiguous")
    return tensor.view(torch.uint8)


class PagedKV:
    """Every layer's pages of one KV cache group, addressed by (manager) block id.

    Args:
        layers: one ``[B', H, N', C]`` view per layer, in the order the stored block keeps
            them; ``B'`` is `num_blocks` times the number of kernel blocks per block.
        num_blocks: blocks of the scheduler's block table.
    """

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int) -> None:
        if not layers:
            raise ConfigError("no KV cache layers to register")
        views = [_bytes_view(t) for t in layers]
        first = views[0]
        kernel_blocks, heads, tokens, width = first.shape
        if num_blocks <= 0 or kernel_blocks % num_blocks:
            raise ConfigError(f"{kernel_blocks} KV blocks per layer is not a multiple of "
                              f"{num_blocks} scheduler blocks")  # fmt: skip
        for view in views[1:]:
            if view.shape != first.shape or view.stride() != first.stride():
                raise ConfigError("all layers of a KV cache group must share shape and strides")
            if view.device != first.device:
                raise ConfigError("all layers of a KV cache group must be on one device")
        ratio = kernel_blocks // num_blocks
        self.device = first.device
        self.num_layers = len(views)
        self.num_blocks = num_blocks
        self.num_kv_heads = int(heads)
        self.block_tokens = int(ratio * tokens)
        self.width_bytes = int(width)  # bytes of one head's K and V at one token
        self.layer_bytes = int(ratio * tokens * heads * width)
        self.block_bytes = self.num_layers * self.layer_bytes
        s_block, s_head, s_token, s_byte = first.stride()
        # [block, ratio, token, head, C]: tokens of a manager block run over its kernel blocks.
        size = (num_blocks, ratio, tokens, heads, width)
        stride = (ratio * s_block, s_block, s_token, s_head, s_byte)
        self._tail = size[1:]
        step = self._layer_step(views)
        self._single: torch.Tensor | None = None
        self._layers: list[torch.Tensor] = []
        if step is not None:
            # All layers lie in one buffer at a fixed distance (layer-compact or cross-layer):
            # one strided view covers them all, so a gather or scatter is one tensor op.
            self._single = torch.as_strided(
                first,
                size=(num_blocks, self.num_layers, *size[1:]),
                stride=(stride[0], step, *stride[1:]),
                storage_offset=first.storage_offset(),
            )
        else:
            self._layers = [
                torch.as_strided(v, size=size, stride=stride, storage_offset=v.storage_offset())
                for v in views
            ]

    @staticmethod
    def _layer_step(views: Sequence[torch.Tensor]) -> int | None:
        """The byte distance between consecutive layers if all share one buffer evenly."""
        first = views[0]
        if len(views) == 1:
            return 0
        storage = first.untyped_storage().data_ptr()
        if any(v.untyped_storage().data_ptr() != storage for v in views):
            return None
        offsets = [v.storage_offset() for v in views]
        step = offsets[1] - offsets[0]
        if any(b - a != step for a, b in zip(offsets, offsets[1:], strict=False)):
            return None
        return int(step)

    def staging(self, blocks: int) -> torch.Tensor:
        """A host buffer for `blocks` whole blocks, ``[blocks, block_bytes]`` (page-locked
        when the cache is on a GPU, so copies to and from it run asynchronously)."""
        pin = self.device.type == "cuda"
        return torch.empty((blocks, self.block_bytes), dtype=torch.uint8, pin_memory=pin)

    def _canonical(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        return buffer[:n].view(n, self.num_layers, *self._tail)

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks `block_ids` into the first rows of `out` (a `staging` buffer).

        On a GPU the copy is queued on the current stream; the caller synchronises.
        """
        n = int(block_ids.numel())
        dst = self._canonical(out, n)
        ids = block_ids.to(self.device, torch.long)
        if self._single is not None:
            if self.device.type == "cpu":
                torch.index_select(self._single, 0, ids, out=dst)
            else:
                dst.copy_(self._single.index_select(0, ids), non_blocking=True)
            return
        for layer, view in enumerate(self._layers):
            dst[:, layer].copy_(view.index_select(0, ids), non_blocking=True)

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the first rows of `src` (a `staging` buffer) into blocks `block_ids`."""
        n = int(block_ids.numel())
        rows = self._canonical(src, n)
        if self.device.type == "cpu":
            # index_copy_ moves these uint8 views one byte at a time; a block's copy_ moves
            # its contiguous runs whole: ~5x faster for SmolLM2's 5.6 MiB blocks
            # (docs/design/workload-benchmark.md, `bench serve`).
            for row, block in enumerate(block_ids.tolist()):
                if self._single is not None:
                    self._single[block].copy_(rows[row])
                else:
                    for layer, view in enumerate(self._layers):
                        view[block].copy_(rows[row, layer])
            return
        ids = block_ids.to(self.device, torch.long)
        rows = rows.to(self.device, non_blocking=True)
        if self._single is not None:
            self._single.index_copy_(0, ids, rows)
            return
        for layer, view in enumerate(self._layers):
            view.index_copy_(0, ids, rows[:, layer])
