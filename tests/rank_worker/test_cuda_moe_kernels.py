"""moe_kernels.py's align and combine against the PyTorch ops moe.grouped_experts used for them (a stable
argsort with counted runs; a float32 weighted sum over each token's slots): batch sizes from one token to past
one align block, expert counts that are and are not powers of two, experts left unchosen.

On CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1, triton importable); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from triton_device import DEVICE, ON_CUDA, TRITON_MARKS

from rank_worker.model import moe_kernels

pytestmark = TRITON_MARKS


def _routing(tokens: int, k: int, experts: int, hot: int) -> torch.Tensor:
    """k distinct experts per token, drawn from the first `hot` (so some experts get nothing)."""
    scores = torch.rand(tokens, hot, device=DEVICE)
    return scores.topk(k, dim=1).indices


@pytest.mark.parametrize(
    ("tokens", "k", "experts", "hot"),
    [(1, 6, 64, 64), (16, 6, 64, 40), (37, 2, 12, 12), (128, 6, 64, 64), (600, 6, 64, 64)],
)
def test_align_gives_the_stable_sort_by_expert(tokens, k, experts, hot) -> None:
    torch.manual_seed(tokens)
    ids = _routing(tokens, k, experts, hot)
    token_of_row, row_of_pair, ends = moe_kernels.align(ids, experts)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=DEVICE).scatter_add_(0, flat, torch.ones_like(flat))
    assert torch.equal(ends.long(), counts.cumsum(0))
    assert torch.equal(token_of_row, order // k)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=DEVICE)
    assert torch.equal(row_of_pair.long(), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if ON_CUDA else torch.float16])
def test_combine_is_the_weighted_slot_sum_in_float32(dtype) -> None:
    torch.manual_seed(5)
    tokens, k, experts, width = 19, 6, 64, 700
    ids = _routing(tokens, k, experts, experts)
    _, row_of_pair, _ = moe_kernels.align(ids, experts)
    h = torch.randn(tokens * k, width, device=DEVICE).to(dtype)
    weights = torch.rand(tokens, k, device=DEVICE)
    out = moe_kernels.combine(h, weights, row_of_pair, dtype)
    per_slot = h.float()[row_of_pair.long()].view(tokens, k, width) * weights.unsqueeze(2)
    expected = per_slot[:, 0]
    for slot in range(1, k):  # in slot order, as the kernel adds
        expected = expected + per_slot[:, slot]
    torch.testing.assert_close(out, expected.to(dtype), rtol=1e-6, atol=1e-6)
