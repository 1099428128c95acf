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
    ("tokens", "k", "experts", "hot", "shared"),
    [
        (1, 6, 64, 64, 0),
        (16, 6, 64, 40, 0),
        (37, 2, 12, 12, 0),
        (128, 6, 64, 64, 0),
        (600, 6, 64, 64, 0),
        (1, 6, 64, 64, 2),  # V2-Lite's two shared experts: slots 6 and 7 of every token, experts 64 and 65
        (130, 6, 64, 50, 2),  # past two align blocks of tokens
        (37, 2, 12, 12, 1),
    ],
)
def test_align_gives_the_stable_sort_by_expert(tokens, k, experts, hot, shared) -> None:
    """The shared experts' slots, placed by arithmetic, land where the stable sort of all ids puts them."""
    torch.manual_seed(tokens)
    ids = _routing(tokens, k, experts, hot)
    if shared:
        ids = torch.cat([ids, torch.arange(experts, experts + shared, device=DEVICE).expand(tokens, -1)], dim=1)
        k, experts = k + shared, experts + shared
    token_of_row, row_of_pair, ends = moe_kernels.align(ids, experts, shared)
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


def _router_reference(x, gate, k, softmax, normalize, scaling):
    """TopkRouter's greedy PyTorch path (moe.py), as it ran before route: float32 gate, scores, top-k."""
    logits = torch.nn.functional.linear(x.float(), gate)
    scores = logits.softmax(dim=-1) if softmax else logits.sigmoid()
    weights, ids = torch.topk(scores, k=k, dim=-1)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


@pytest.mark.parametrize(
    ("tokens", "hidden", "experts", "k", "softmax", "normalize", "scaling"),
    [
        (1, 2048, 64, 6, True, False, 1.0),  # V2-Lite at batch 1
        (16, 2048, 64, 6, True, False, 1.0),
        (37, 96, 12, 2, True, True, 1.0),  # a partial block of tokens; experts not a power of two
        (5, 200, 256, 8, False, True, 2.5),  # sigmoid scores, renormalised and scaled; hidden not a multiple of 64
        # a hidden size past 32 slices of 64 (each logits program loops over 3), four expert blocks, ragged ends
        (3, 64 * 32 * 2 + 40, 160, 8, False, True, 2.5),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if ON_CUDA else torch.float16])
def test_route_picks_the_k_best_experts_as_the_pytorch_router_does(
    tokens, hidden, experts, k, softmax, normalize, scaling, dtype
) -> None:
    torch.manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    gate = torch.randn(experts, hidden, device=DEVICE) / hidden**0.5
    ids, weights = moe_kernels.route(x, gate, k, softmax, normalize, scaling)
    expected_ids, expected_weights = _router_reference(x, gate, k, softmax, normalize, scaling)
    assert ids.shape == (tokens, k) and ids.dtype == torch.int64 and weights.dtype == torch.float32
    # best first, as torch.topk(sorted=True) gives them (random scores: no ties)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("k", "shared", "normalize", "scaling"), [(6, 2, False, 1.0), (8, 1, True, 2.5), (2, 2, True, 1.0)]
)
def test_route_appends_the_shared_experts_at_weight_one_after_the_routed_slots(k, shared, normalize, scaling) -> None:
    """The shared experts (stacked after the routed ones: ids experts..) in slots k.., weight 1, unscaled and left
    out of the renormalisation; the routed slots as without them."""
    torch.manual_seed(k + shared)
    tokens, hidden, experts = 21, 128, 64
    x = torch.randn(tokens, hidden, device=DEVICE)
    gate = torch.randn(experts, hidden, device=DEVICE) / hidden**0.5
    ids, weights = moe_kernels.route(x, gate, k, True, normalize, scaling, shared)
    routed_ids, routed_weights = moe_kernels.route(x, gate, k, True, normalize, scaling)
    assert ids.shape == weights.shape == (tokens, k + shared)
    assert torch.equal(ids[:, :k], routed_ids) and torch.equal(weights[:, :k], routed_weights)
    assert torch.equal(ids[:, k:], torch.arange(experts, experts + shared, device=DEVICE).expand(tokens, -1))
    assert torch.equal(weights[:, k:], torch.ones(tokens, shared, device=DEVICE))


@pytest.mark.parametrize("tokens", [1, 40])
def test_a_decode_steps_kernels_give_the_routed_experts_plus_the_shared_mlp(tokens) -> None:
    """route (with 2 shared slots) -> align over the 66 stacked experts -> moe_mlp_kernel.expert_mlp -> combine,
    in float32, against the unfused sum: each token's routed experts weighted, plus the shared experts as one MLP
    of twice the intermediate size (transformers' shared_experts)."""
    from rank_worker.model import moe_mlp_kernel

    torch.manual_seed(tokens)
    hidden, inter, experts, shared, k = 128, 32, 64, 2, 6
    x = torch.randn(tokens, hidden, device=DEVICE)
    gate = torch.randn(experts, hidden, device=DEVICE) / hidden**0.5
    gate_up = torch.randn(experts + shared, 2 * inter, hidden, device=DEVICE) / hidden**0.5
    down = torch.randn(experts + shared, hidden, inter, device=DEVICE) / inter**0.5
    ids, weights = moe_kernels.route(x, gate, k, True, False, 1.0, shared)
    token_of_row, row_of_pair, ends = moe_kernels.align(ids, experts + shared, shared)
    h = moe_mlp_kernel.expert_mlp(x, gate_up, down, token_of_row, ends)
    out = moe_kernels.combine(h, weights, row_of_pair, x.dtype)

    def mlp(rows, w_gate_up, w_down):
        g, u = (rows @ w_gate_up.T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u) @ w_down.T

    expected = torch.zeros_like(x)
    for t in range(tokens):
        for slot in range(k):
            e = int(ids[t, slot])
            expected[t] += weights[t, slot] * mlp(x[t], gate_up[e], down[e])
    # the shared experts as transformers holds them: one MLP, gate rows then up rows of 2 x inter each
    shared_gate = torch.cat([gate_up[experts + s, :inter] for s in range(shared)])
    shared_up = torch.cat([gate_up[experts + s, inter:] for s in range(shared)])
    shared_down = torch.cat([down[experts + s] for s in range(shared)], dim=1)
    expected += mlp(x, torch.cat([shared_gate, shared_up]), shared_down)
    # expert_mlp's float32 tl.dot is tf32 on CUDA (test_cuda_moe_mlp_kernel's tolerance); exact in the interpreter
    tol = 2e-2 if ON_CUDA else 1e-4
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_route_reads_a_strided_batch_and_a_tie_goes_to_the_lower_expert() -> None:
    x = torch.zeros(3, 2 * 64, device=DEVICE)[:, ::2]  # every score equal: a 64-way tie
    ids, weights = moe_kernels.route(x, torch.ones(64, 64, device=DEVICE), 6, True, False, 1.0)
    assert torch.equal(ids, torch.arange(6, device=DEVICE).expand(3, 6))
    torch.testing.assert_close(weights, torch.full((3, 6), 1 / 64, device=DEVICE))
