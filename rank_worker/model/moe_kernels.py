"""Two Triton kernels around MoE's grouped GEMMs (moe.py grouped_experts), for the small batches of decode steps:

- align: the (token, slot) pairs sorted by expert, stably, as the grouped GEMMs take them: for each sorted row
  the token it reads, each pair's row, and the runs' ends. One program, O(pairs x experts); in eager PyTorch
  this was an argsort, a scatter-add of counts, a cumsum and an index division (~7 launches).
- combine: each token's k expert outputs weighted and summed in float32 in slot order, then rounded to the
  model's dtype (was a cast, a gather of the weights, a product, an index_copy back to pair order, a sum
  and a cast).

A V2-Lite decode step of one token spent more time launching MoE's small ops than reading its experts' weights
(bench/results/peer-dsv2-lite-h200.json: 7.5 ms against vLLM's 3.5). Large batches (prefill chunks: a
single-program align would loop over 100K+ pairs) keep the PyTorch sort; ALIGN_MAX_PAIRS is where.
"""

from __future__ import annotations

import torch

from rank_worker.model.fused_ops import triton

ALIGN_MAX_PAIRS = 4096  # decode batches (256 rows x 8 experts a token at most); prefill sorts in PyTorch
ALIGN_BLOCK = 64  # pairs per loop iteration of align: a [64, experts] one-hot tile

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _align(
        ids_ptr,
        token_of_row_ptr,
        row_of_pair_ptr,
        ends_ptr,
        pairs,
        K: tl.constexpr,
        EXPERTS: tl.constexpr,
        EXPERTS_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        experts = tl.arange(0, EXPERTS_PAD)
        offsets = tl.arange(0, BLOCK)
        # pass 1: pairs per expert
        counts = tl.zeros([EXPERTS_PAD], tl.int32)
        for start in range(0, pairs, BLOCK):
            p = start + offsets
            e = tl.load(ids_ptr + p, mask=p < pairs, other=EXPERTS_PAD)  # padding matches no expert
            counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
        ends = tl.cumsum(counts, axis=0)
        tl.store(ends_ptr + experts, ends, mask=experts < EXPERTS)
        seen = ends - counts  # each expert's next free row: its run's start, then past the pairs placed
        # pass 2: each pair's row = its expert's start + the pairs of that expert before it (a stable sort)
        for start in range(0, pairs, BLOCK):
            p = start + offsets
            ok = p < pairs
            e = tl.load(ids_ptr + p, mask=ok, other=EXPERTS_PAD)
            hot = (e[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK, EXPERTS_PAD]
            before = tl.cumsum(hot, axis=0) - hot  # same-expert pairs earlier in this block
            row = tl.sum(hot * (before + seen[None, :]), axis=1)
            tl.store(row_of_pair_ptr + p, row, mask=ok)
            tl.store(token_of_row_ptr + row, p // K, mask=ok)
            seen += tl.sum(hot, axis=0)

    @triton.jit
    def _combine(h_ptr, weights_ptr, row_of_pair_ptr, out_ptr, width, K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        acc = tl.zeros([BLOCK], tl.float32)
        for slot in tl.static_range(K):
            row = tl.load(row_of_pair_ptr + token * K + slot).to(tl.int64)
            weight = tl.load(weights_ptr + token * K + slot)
            acc += tl.load(h_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32) * weight
        tl.store(out_ptr + token * width + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def align(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] (int) -> (token_of_row [T k] int64: the token each expert-sorted row reads, row_of_pair [T k]
    int32: each (token, slot) pair's row, ends [experts] int32: each expert's run end), with pairs of one expert
    in (token, slot) order: what torch.argsort(ids.flatten(), stable=True) gives."""
    assert triton is not None
    tokens, k = ids.shape
    pairs = tokens * k
    assert pairs <= ALIGN_MAX_PAIRS, pairs
    flat = ids.reshape(-1).to(torch.int32)
    token_of_row = torch.empty(pairs, dtype=torch.int64, device=ids.device)
    row_of_pair = torch.empty(pairs, dtype=torch.int32, device=ids.device)
    ends = torch.empty(experts, dtype=torch.int32, device=ids.device)
    _align[(1,)](
        flat,
        token_of_row,
        row_of_pair,
        ends,
        pairs,
        K=k,
        EXPERTS=experts,
        EXPERTS_PAD=triton.next_power_of_2(experts),
        BLOCK=ALIGN_BLOCK,
        num_warps=4,
    )
    return token_of_row, row_of_pair, ends


def combine(h: torch.Tensor, weights: torch.Tensor, row_of_pair: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """h [T k, H] (expert-sorted rows), weights [T, k] float32, row_of_pair [T k] -> [T, H] in dtype: each
    token's sum over its slots, in slot order, of its row of h times its weight, in float32."""
    assert triton is not None
    tokens, k = weights.shape
    width = h.shape[1]
    out = torch.empty(tokens, width, dtype=dtype, device=h.device)
    if tokens:
        block = 512
        _combine[(tokens, triton.cdiv(width, block))](
            h.contiguous(), weights.contiguous(), row_of_pair, out, width, K=k, BLOCK=block, num_warps=4
        )
    return out
