"""PagedKV on CPU views laid out the way vLLM 0.33.0 lays out its KV cache (no vLLM needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvoffload.connectors.paged_kv import PagedKV  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

L, B, H, N, C = 3, 10, 2, 16, 8
# Physical order of the logical axes (L, B, H, N, C), outermost first (vLLM's KVCacheLayout).
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def _views(order: tuple[int, ...], blocks: int = B, tokens: int = N) -> list[torch.Tensor]:
    """One [blocks, H, tokens, C] float16 view per layer over one buffer in `order`."""
    sizes = (L, blocks, H, tokens, C)
    strides = [0] * 5
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= sizes[axis]
    g = torch.Generator().manual_seed(len(order) + blocks)
    raw = torch.randint(-(2**15), 2**15, (step,), dtype=torch.int16, generator=g)
    flat = raw.view(torch.float16)
    return [
        torch.as_strided(flat, (blocks, H, tokens, C), tuple(strides[1:]), layer * strides[0])
        for layer in range(L)
    ]


def _canonical(views: list[torch.Tensor], block: int) -> torch.Tensor:
    """Block `block` as [layer][token][head][C] bytes, straight from the views."""
    return torch.stack([v[block].permute(1, 0, 2) for v in views]).contiguous().view(torch.uint8)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gather_and_scatter_use_one_byte_order_for_every_layout(layout: str) -> None:
    views = _views(LAYOUTS[layout])
    kv = PagedKV(views, B)
    assert (kv.num_layers, kv.block_tokens, kv.num_kv_heads) == (L, N, H)
    assert kv.block_bytes == L * N * H * C * 2
    staging = kv.staging(4)
    kv.gather(torch.tensor([7, 2, 9]), staging)
    for row, block in enumerate((7, 2, 9)):
        assert torch.equal(staging[row], _canonical(views, block).flatten())
    # Scatter writes exactly the chosen blocks, from the same byte order.
    before = [v.clone() for v in views]
    kv.scatter(torch.tensor([4, 0]), staging)
    for layer, view in enumerate(views):
        for block in range(B):
            source = {4: 7, 0: 2}.get(block)
            want = before[layer][source if source is not None else block]
            assert torch.equal(view[block].view(torch.int16), want.view(torch.int16))


def test_blocks_move_between_layouts_unchanged() -> None:
    compact, cross = _views(LAYOUTS["LBNHC"]), _views(LAYOUTS["BLHNC"])
    staging = PagedKV(compact, B).staging(1)
    PagedKV(compact, B).gather(torch.tensor([3]), staging)
    PagedKV(cross, B).scatter(torch.tensor([6]), staging)
    for a, b in zip(compact, cross, strict=True):
        assert torch.equal(a[3].view(torch.int16), b[6].view(torch.int16))


def test_kernel_blocks_make_up_a_scheduler_block() -> None:
    # Attention kernels with 8-token blocks under 16-token scheduler blocks: two kernel blocks
    # per block, their tokens in order.
    views = _views(LAYOUTS["LBNHC"], blocks=2 * B, tokens=N // 2)
    kv = PagedKV(views, B)
    assert kv.block_tokens == N
    staging = kv.staging(1)
    kv.gather(torch.tensor([5]), staging)
    want = torch.stack(
        [torch.cat([v[10], v[11]], dim=1).permute(1, 0, 2) for v in views]
    ).contiguous()
    assert torch.equal(staging[0], want.view(torch.uint8).flatten())


def test_layers_in_separate_buffers_still_move_as_one_block() -> None:
    views = [_views(LAYOUTS["LBHNC"])[0].clone() for _ in range(L)]
    for i, view in enumerate(views):
        view.view(torch.int16).add_(i)
    kv = PagedKV(views, B)
    staging = kv.staging(2)
    kv.gather(torch.tensor([1, 8]), staging)
    assert torch.equal(staging[1], _canonical(views, 8).flatten())
    kv.scatter(torch.tensor([0]), staging)
    assert torch.equal(_canonical(views, 0), _canonical(views, 1))


def test_inconsistent_views_are_refused() -> None:
    views = _views(LAYOUTS["LBNHC"])
    with pytest.raises(ConfigError):
        PagedKV(views, 3)  # 10 blocks are not a multiple of 3
    with pytest.raises(ConfigError):
        PagedKV([views[0], views[1][:, :1]], B)  # layers of different shapes
    with pytest.raises(ConfigError):
        PagedKV([], B)
    with pytest.raises(ConfigError):
        PagedKV([views[0].transpose(2, 3)], B)  # C not contiguous
