"""moe_mlp_kernel.expert_mlp (the routed experts' gate/up + SiLU x up + down over align's sorted rows) against
each expert's MLP in PyTorch, row by row: one token to past several row blocks per expert and past MANY_PAIRS
(the 32-row launch), experts left unhit, widths that are not multiples of the tiles, and other program layouts
than the default (the probe's sweep).

On CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1, triton importable); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from triton_device import DEVICE, ON_CUDA, TRITON_MARKS

from rank_worker.model import fused_ops, moe_kernels, moe_mlp_kernel

pytestmark = TRITON_MARKS
DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float16, torch.float32]


def _reference(x, gate_up, down, token_of_row, ends):
    """Each sorted row's expert MLP as MoE.experts_hit computes one: the unfused ops, rounding where they do."""
    out = torch.empty(token_of_row.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        rows = x[token_of_row[start:end]]
        h = fused_ops.silu_and_mul_reference((rows.float() @ gate_up[expert].float().T).to(x.dtype))
        out[start:end] = (h.float() @ down[expert].float().T).to(x.dtype)
        start = end
    return out


SHAPES = [  # (tokens, k, experts, hot, hidden, inter)
    (1, 6, 64, 64, 96, 80),
    (16, 6, 64, 40, 64, 48),
    (37, 2, 12, 3, 64, 40),
    (70, 4, 10, 10, 160, 72),
    (300, 4, 16, 16, 64, 48),
]
LAUNCHES = [
    None,
    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2, "num_stages": 3},
]
# The interpreter runs each program in Python: the other layouts' small tiles over many hit experts take 2-4 s of
# CPU a case there (slow_interpreter). CI sweeps them over the shapes of few programs: one token, 3 experts hit.
FEW_PROGRAMS = {SHAPES[0], SHAPES[2]}
LAUNCH_CASES = [  # each launch over each shape
    pytest.param(
        launch,
        *shape,
        id="-".join(map(str, [f"launch{index}" if launch else "None", *shape])),
        marks=[] if launch is None or shape in FEW_PROGRAMS else [pytest.mark.slow_interpreter],
    )
    for index, launch in enumerate(LAUNCHES)
    for shape in SHAPES
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("launch", "tokens", "k", "experts", "hot", "hidden", "inter"), LAUNCH_CASES)
def test_expert_mlp_gives_each_rows_expert_mlp(dtype, tokens, k, experts, hot, hidden, inter, launch) -> None:
    torch.manual_seed(tokens * 7 + k)
    ids = torch.rand(tokens, hot, device=DEVICE).topk(k, dim=1).indices  # only the first `hot` experts hit
    token_of_row, _, ends = moe_kernels.align(ids, experts)
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device=DEVICE) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, device=DEVICE) / inter**0.5).to(dtype)
    got = moe_mlp_kernel.expert_mlp(x, gate_up, down, token_of_row, ends, launch, launch)
    expected = _reference(x, gate_up, down, token_of_row, ends)
    # float32 sums in another order (tl.dot's tiles; on CUDA tf32 for float32), then one rounding of the dtype
    tol = {torch.float32: 2e-2 if ON_CUDA else 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_no_pairs_gives_no_rows() -> None:
    x = torch.randn(0, 64, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    ends = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    out = moe_mlp_kernel.expert_mlp(
        x, torch.randn(4, 96, 64, device=DEVICE), torch.randn(4, 64, 48, device=DEVICE), empty, ends
    )
    assert out.shape == (0, 64)
