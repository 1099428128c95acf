"""fused_ops.add_rms_norm on a column slice of a wider product (MLA's q_a, a slice of the layer's one input
projection: mla.py): the rows read at their stride, the same bits as for a contiguous copy (and close to the
PyTorch reference), with and without a residual added in place.

On CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1, triton importable); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from triton_device import DEVICE, ON_CUDA, TRITON_MARKS

from rank_worker.model import fused_ops

pytestmark = TRITON_MARKS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if ON_CUDA else torch.float16])
def test_add_rms_norm_reads_a_column_slice_at_its_row_stride(dtype) -> None:
    torch.manual_seed(2)
    product = torch.randn(7, 96 + 40, device=DEVICE).to(dtype)
    x = product[:, :96]  # rows 136 apart
    assert not x.is_contiguous()
    weight = torch.randn(96, device=DEVICE).to(dtype)
    out = fused_ops.add_rms_norm(x, None, weight, 1e-6)
    assert out.is_contiguous()
    assert torch.equal(out, fused_ops.add_rms_norm(x.contiguous(), None, weight, 1e-6))
    close = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, fused_ops.rms_norm_reference(x.contiguous(), weight, 1e-6), **close)
    residual = torch.randn(7, 96, device=DEVICE).to(dtype)
    stream, contiguous_stream = residual.clone(), residual.clone()
    out = fused_ops.add_rms_norm(x, stream, weight, 1e-6)
    assert torch.equal(stream, x + residual)
    assert torch.equal(out, fused_ops.add_rms_norm(x.contiguous(), contiguous_stream, weight, 1e-6))
    torch.testing.assert_close(out, fused_ops.rms_norm_reference(x + residual, weight, 1e-6), **close)
