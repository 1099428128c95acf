"""The Triton paged decode kernel against the gather + SDPA path, on CUDA (skipped elsewhere): GQA groups,
head sizes, lengths from one token to several split-K slices, scattered blocks, bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from rank_worker.model import paged_decode_kernel
from rank_worker.model.forward_batch import DecodeGroup, ForwardBatch
from rank_worker.model.paged_attention import paged_attention

pytestmark = pytest.mark.skipif(not paged_decode_kernel.available(), reason="needs CUDA and Triton")


def test_use_kernel_resolves_the_setting() -> None:
    assert paged_decode_kernel.use_kernel("auto", True, 128)
    assert not paged_decode_kernel.use_kernel("sdpa", True, 128)
    assert not paged_decode_kernel.use_kernel("auto", True, 96)  # not a power of two: SDPA
    assert not paged_decode_kernel.use_kernel("auto", False, 128)
    with pytest.raises(RuntimeError):
        paged_decode_kernel.use_kernel("triton", False, 128)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64), (4, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_gather_and_sdpa(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    block_size, num_blocks, layers = 16, 400, 2
    lengths = [1, 15, 16, 17, 511, 512, 513, 1500, 3000]
    pool = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, device=device).to(dtype)
    order = torch.randperm(num_blocks - 1, device=device) + 1  # scattered, never block 0
    max_blocks = -(-max(lengths) // block_size) + 3  # wider than needed, as padded tables are
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.long, device=device)
    used = 0
    for row, length in enumerate(lengths):
        count = -(-length // block_size)
        tables[row, :count] = order[used : used + count]
        used += count
    lens = torch.tensor(lengths, device=device)
    q = torch.randn(len(lengths), heads, head_dim, device=device).to(dtype)
    layer = pool[:, 1]
    k_cache, v_cache = layer[:, 0], layer[:, 1]
    scale = head_dim**-0.5

    def attend(kernel: bool) -> torch.Tensor:
        group = DecodeGroup(len(lengths), tables, lens, max(lengths), paged_kernel=kernel)
        batch = ForwardBatch(q[:, 0, 0].long(), lens - 1, lens, lens, group, [], lens)
        return paged_attention(q, q, q, k_cache, v_cache, batch, scale)

    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(attend(True), attend(False), rtol=tolerance, atol=tolerance)
