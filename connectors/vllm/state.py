"""Mamba / linear-attention state of a hybrid model, moved as blocks.

With Mamba prefix caching in align mode (``--mamba-cache-mode align``), vLLM 0.32/0.33 keeps,
for a block boundary it caches, one block of the Mamba group holding every layer's recurrent
state (e.g. a conv state and an SSM state) after the boundary's last token. vLLM lays each
layer's state block out as a raw ``[blocks, 1, 1, C]`` int8 page view (``MambaSpec``'s
``state_content_size_bytes`` C, pages possibly padded); the layer unpacks its states from the
C bytes (`MambaBase.bind_kv_cache`).

The connector stores that block under the boundary's hash, beside the attention groups' KV of
the same boundary, in a namespace that names the state's kind, shapes and dtypes (so neither KV
nor a state of another layout answers for it). Which block holds a boundary's state is not
positional in align mode (vLLM nulls and relocates state blocks), so the scheduler takes it
from vLLM's own hand-off, `KVConnectorBlockState.boundary_state_offloads`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvoffload.client_sdk import Client
from kvoffload.errors import ConfigError

__all__ = ["DAMAGE", "FAULTS_ENV", "ZERO_UNVERIFIED", "StateKV", "check_state_codec",
           "damage_part", "planted_fault"]  # fmt: skip

# Fault seam for the served tests (`test_vllm_hybrid_serve.py`), as `KVOFFLOAD_FAULTS` is the
# store's: off unless this variable names a file, whose content names the fault (empty or no
# file: none). Read again whenever it changes, so a test plants a fault in a running server.
FAULTS_ENV = "KVOFFLOAD_VLLM_FAULTS"
# Flip one bit of the next state part a load reads, in the store, behind the SDK's back (once
# per change of the file): the check must catch it and the hit end before it.
DAMAGE = "damage-state"
# Negative control: restore every loaded state as zeros, as a cache that restored the KV but
# not the state would; the served answer must then differ.
ZERO_UNVERIFIED = "zero-state-unverified"
_FAULTS = ("", DAMAGE, ZERO_UNVERIFIED)
_fault_lock = threading.Lock()
_damaged: tuple[int, int] | None = None  # the plan file version a part was damaged under


def planted_fault(take_damage: bool = False) -> str:
    """The fault the seam's file names ("" when off). With `take_damage`, `DAMAGE` is
    returned once per version of the file, then "".

    Raises:
        ConfigError: the file names an unknown fault.
    """
    global _damaged
    path = os.environ.get(FAULTS_ENV)
    if not path:
        return ""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as fh:
            fault = fh.read().strip()
    except FileNotFoundError:
        return ""
    if fault not in _FAULTS:
        raise ConfigError(f"{FAULTS_ENV}: {path} names {fault!r}; expected one of {_FAULTS}")
    if fault == DAMAGE and take_damage:
        with _fault_lock:
            stamp = (st.st_ino, st.st_mtime_ns)
            if _damaged == stamp:
                return ""
            _damaged = stamp
    return fault


def damage_part(client: Client, key: bytes) -> None:
    """Flip one bit of the stored part `key` through the raw transport (its header still
    describes the old bytes), as a bad disk or a rogue node would."""
    held = client.transport.get(key[:16])
    if held is None:
        return
    damaged = bytearray(held.data)
    held.release()
    damaged[-1] ^= 0x10
    client.transport.put(key[:16], [bytes(damaged)], None)


def check_state_codec(client: Client, group: str) -> None:
    """Refuse a client that writes with a lossy codec for a state group: a recurrent state's
    error is carried into every later token's state, so it compounds instead of staying in
    one block.

    Raises:
        ConfigError: the client's codec is lossy.
    """
    codec = client.codec
    if not codec.lossless:
        raise ConfigError(
            f"{group} holds Mamba / linear-attention state, which must be stored losslessly "
            f"(its errors compound over every later token); codec {codec.name!r} is lossy: "
            "use a lossless codec (none, zstd, ...) for this model"
        )


def _pieces(cache: Any, num_blocks: int, content: int, name: str) -> list[torch.Tensor]:
    """One layer's state bytes as ``[num_blocks, n]`` uint8 views: from vLLM's raw page view
    (its first `content` bytes; the rest is padding) or from per-state views."""
    tensors = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    pieces = []
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
            raise ConfigError(f"layer {name}: expected state views [blocks, ...], got {cache!r}")
        if tensor.shape[0] != num_blocks:
            raise ConfigError(f"layer {name}: {tensor.shape[0]} state blocks, the KV cache "
                              f"config says {num_blocks}")  # fmt: skip
        rows = tensor.flatten(1)
        if rows.stride(-1) != 1:
            raise ConfigError(f"layer {name}: a state block's bytes must be contiguous")
        pieces.append(rows.view(torch.uint8))
    width = sum(int(p.shape[1]) for p in pieces)
    if len(pieces) == 1 and width > content:
        pieces = [pieces[0][:, :content]]  # a padded page
    elif width != content:
        raise ConfigError(f"layer {name}: state views hold {width} bytes per block, the "
                          f"state spec says {content}")  # fmt: skip
    return pieces


class StateKV:
    """Every layer's state blocks of one Mamba / linear-attention group, by block id: the
    `PagedKV` operations the worker uses (staging, gather, scatter), over state bytes.

    Args:
        layers: vLLM's cache of each layer of the group, in the group's order.
        num_blocks: blocks of the scheduler's block table.
        content: state bytes of one layer's block (`MambaSpec.state_content_size_bytes`).
        names: the layers' names (for error messages).

    Raises:
        ConfigError: the views disagree with the state spec.
    """

    def __init__(
        self, layers: Sequence[Any], num_blocks: int, content: int, names: Sequence[str]
    ) -> None:
        if not layers:
            raise ConfigError("no state layers to register")
        self._pieces = [p for cache, name in zip(layers, names, strict=True)
                        for p in _pieces(cache, num_blocks, content, name)]  # fmt: skip
        self.device = self._pieces[0].device
        self.num_layers = len(layers)
        self.num_blocks = num_blocks
        self.block_bytes = content * len(layers)

    def staging(self, blocks: int) -> torch.Tensor:
        """A host buffer for `blocks` state blocks, ``[blocks, block_bytes]``."""
        pin = self.device.type == "cuda"
        return torch.empty((blocks, self.block_bytes), dtype=torch.uint8, pin_memory=pin)

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy state blocks `block_ids` into the first rows of `out`, layer after layer."""
        n = int(block_ids.numel())
        ids = block_ids.to(self.device, torch.long)
        offset = 0
        for piece in self._pieces:
            width = int(piece.shape[1])
            out[:n, offset : offset + width].copy_(piece.index_select(0, ids), non_blocking=True)
            offset += width

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the first rows of `src` into state blocks `block_ids`."""
        offset = 0
        for piece in self._pieces:
            width = int(piece.shape[1])
            for row, block in enumerate(block_ids.tolist()):
                piece[block].copy_(src[row, offset : offset + width], non_blocking=True)
            offset += width
