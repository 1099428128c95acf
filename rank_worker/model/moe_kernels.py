"""Three Triton kernels around MoE's grouped GEMMs (moe.py), for the small batches of decode steps:

- route: greedy top-k routing (TopkRouter's greedy method: softmax or sigmoid scores of the float32 gate,
  the k best, optionally renormalised and scaled) in two launches (the gate GEMM split over the hidden size, then
  the scores and the pick); in eager PyTorch a cast, the gate GEMM, the scores and the top-k were four launches a
  layer (~25 us at 16 rows on the H200). It also writes the shared experts' slots (MoE runs them as experts every
  token takes at weight 1), so nothing is concatenated after.

- align: the (token, slot) pairs sorted by expert, stably, as the grouped GEMMs take them: for each sorted row
  the token it reads, each pair's row, and the runs' ends. One program, O(pairs x experts); in eager PyTorch
  this was an argsort, a scatter-add of counts, a cumsum and an index division (~7 launches). The shared
  experts' slots (one a token each, always last) are placed by arithmetic, not sorted: they would double the
  one-hot tiles (66 experts pad to 128) and add a third to the pairs.
- combine: each token's k expert outputs weighted and summed in float32 in slot order, then rounded to the
  model's dtype (was a cast, a gather of the weights, a product, an index_copy back to pair order, a sum
  and a cast).

A V2-Lite decode step of one token spent more time launching MoE's small ops than reading its experts' weights
(twice vLLM's step time). Large batches (prefill chunks: a
single-program align would loop over 100K+ pairs) keep the PyTorch sort; ALIGN_MAX_PAIRS is where.
"""

from __future__ import annotations

import torch

from rank_worker.model.fused_ops import triton

ALIGN_MAX_PAIRS = 4096  # decode batches (256 rows x 8 experts a token at most); prefill sorts in PyTorch
ROUTE_MAX_TOKENS = 256  # decode batches; prefill chunks route in PyTorch (one cuBLAS GEMM)
ROUTE_BLOCK_T = 16  # tokens a route program scores (tl.dot's smallest M)
# route's logits are one program per (16 tokens, 64 hidden values, up to 64 experts): V2-Lite's gate (64 x 2048
# float32, 512 KB) is read by 32 programs at once, not by one in a loop; a second launch sums the slices and picks
ROUTE_BLOCK_H = 64
ROUTE_BLOCK_E = 64
ROUTE_MAX_SLICES = 32  # the pick's serial sum over the slices stays short for a wider hidden size
# Pairs per loop iteration of align (a [block, experts] one-hot tile): the pairs rounded up to a power of two, in
# 16..256, so a batch of up to ~256 pairs is one iteration and V2-Lite's 128 rows (768 routed pairs) three, not
# twelve: the iterations are the one program's serial chain.
ALIGN_BLOCKS = (16, 256)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _align(
        ids_ptr,
        token_of_row_ptr,
        row_of_pair_ptr,
        ends_ptr,
        tokens,
        K: tl.constexpr,
        SHARED: tl.constexpr,
        EXPERTS: tl.constexpr,
        EXPERTS_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """The routed pairs (each token's first K slots of K + SHARED) sorted by their EXPERTS experts; the
        shared experts' slots, one a token for each of the experts after them, placed by arithmetic: shared
        expert s takes the rows routed + s * tokens.. in token order, as a stable sort of the ids would."""
        experts = tl.arange(0, EXPERTS_PAD)
        offsets = tl.arange(0, BLOCK)
        pairs = tokens * K  # routed pairs
        # pass 1: pairs per expert
        counts = tl.zeros([EXPERTS_PAD], tl.int32)
        for start in range(0, pairs, BLOCK):
            p = start + offsets
            at = (p // K) * (K + SHARED) + p % K
            e = tl.load(ids_ptr + at, mask=p < pairs, other=EXPERTS_PAD)  # padding matches no expert
            counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
        ends = tl.cumsum(counts, axis=0)
        tl.store(ends_ptr + experts, ends, mask=experts < EXPERTS)
        seen = ends - counts  # each expert's next free row: its run's start, then past the pairs placed
        # pass 2: each pair's row = its expert's start + the pairs of that expert before it (a stable sort)
        for start in range(0, pairs, BLOCK):
            p = start + offsets
            ok = p < pairs
            token = p // K
            at = token * (K + SHARED) + p % K
            e = tl.load(ids_ptr + at, mask=ok, other=EXPERTS_PAD)
            hot = (e[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK, EXPERTS_PAD]
            before = tl.cumsum(hot, axis=0) - hot  # same-expert pairs earlier in this block
            row = tl.sum(hot * (before + seen[None, :]), axis=1)
            tl.store(row_of_pair_ptr + at, row, mask=ok)
            tl.store(token_of_row_ptr + row, token, mask=ok)
            seen += tl.sum(hot, axis=0)
        for s in tl.static_range(SHARED):
            tl.store(ends_ptr + EXPERTS + s, pairs + (s + 1) * tokens)
            for start in range(0, tokens, BLOCK):
                t = start + offsets
                ok = t < tokens
                row = pairs + s * tokens + t
                tl.store(row_of_pair_ptr + t * (K + SHARED) + K + s, row, mask=ok)
                tl.store(token_of_row_ptr + row, t, mask=ok)

    @triton.jit
    def _route_logits(
        x_ptr,
        gate_ptr,
        partial_ptr,
        tokens,
        stride_x,
        HIDDEN: tl.constexpr,
        EXPERTS: tl.constexpr,
        EXPERTS_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_E: tl.constexpr,
        STEPS: tl.constexpr,
    ):
        """One (token block, hidden slice of STEPS x BLOCK_H, expert block) of x . gate^T in float32, into the
        slice's own part of partial[slice, token, expert]: the gate's read is spread over the whole grid (one program
        reading all of V2-Lite's 512 KB took 86 us a layer on the H200)."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < tokens
        experts = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
        expert_ok = experts < EXPERTS
        logits = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for step in tl.static_range(STEPS):
            cols = (tl.program_id(1) * STEPS + step) * BLOCK_H + tl.arange(0, BLOCK_H)
            col_ok = cols < HIDDEN
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=row_ok[:, None] & col_ok, other=0.0)
            gate_at = gate_ptr + experts[:, None] * HIDDEN + cols[None, :]
            gate = tl.load(gate_at, mask=expert_ok[:, None] & col_ok, other=0.0)
            # float32 products, as F.linear(x.float(), gate) computes them (the gate is kept in float32)
            logits += tl.dot(x.to(tl.float32), tl.trans(gate), input_precision="ieee")
        at = (tl.program_id(1) * tokens + rows[:, None]) * EXPERTS_PAD + experts[None, :]
        tl.store(partial_ptr + at, logits, mask=row_ok[:, None] & (experts[None, :] < EXPERTS_PAD))

    @triton.jit
    def _route_pick(
        partial_ptr,
        ids_ptr,
        weights_ptr,
        tokens,
        scaling,
        SLICES: tl.constexpr,
        EXPERTS: tl.constexpr,
        EXPERTS_PAD: tl.constexpr,
        K: tl.constexpr,
        SHARED: tl.constexpr,
        K_PAD: tl.constexpr,
        SOFTMAX: tl.constexpr,
        NORMALIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        """The logits summed over the hidden slices in slice order (a fixed order: a token's routing does not
        depend on the batch), then the scores and the k best."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < tokens
        experts = tl.arange(0, EXPERTS_PAD)
        expert_ok = experts < EXPERTS
        logits = tl.zeros([BLOCK_T, EXPERTS_PAD], tl.float32)
        for part in range(SLICES):
            at = (part * tokens + rows[:, None]) * EXPERTS_PAD + experts[None, :]
            logits += tl.load(partial_ptr + at, mask=row_ok[:, None], other=0.0)
        if SOFTMAX:
            logits = tl.where(expert_ok[None, :], logits, float("-inf"))
            exp = tl.exp(logits - tl.max(logits, 1)[:, None])
            scores = exp / tl.sum(exp, 1)[:, None]
        else:
            scores = tl.sigmoid(logits)
        left = tl.where(expert_ok[None, :], scores, float("-inf"))
        slots = tl.arange(0, K_PAD)
        chosen = tl.zeros([BLOCK_T, K_PAD], tl.int32)
        weights = tl.zeros([BLOCK_T, K_PAD], tl.float32)
        for slot in tl.static_range(K):  # the k best, best first; a tie goes to the lower expert id
            best = tl.max(left, 1)
            pick = tl.min(tl.where(left == best[:, None], experts[None, :], EXPERTS_PAD), 1)
            chosen = tl.where(slots[None, :] == slot, pick[:, None], chosen)
            weights = tl.where(slots[None, :] == slot, best[:, None], weights)
            left = tl.where(experts[None, :] == pick[:, None], float("-inf"), left)
        if NORMALIZE:
            weights = weights / (tl.sum(weights, 1)[:, None] + 1e-20)
        weights = weights * scaling
        # the shared experts (ids EXPERTS.., stacked after the routed ones) at weight 1, after the routed slots
        shared = (slots[None, :] >= K) & (slots[None, :] < K + SHARED)
        chosen = tl.where(shared, EXPERTS + slots[None, :] - K, chosen)
        weights = tl.where(shared, 1.0, weights)
        at = rows[:, None] * (K + SHARED) + slots[None, :]
        ok = row_ok[:, None] & (slots[None, :] < K + SHARED)
        tl.store(ids_ptr + at, chosen.to(tl.int64), mask=ok)
        tl.store(weights_ptr + at, weights, mask=ok)

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


def align(ids: torch.Tensor, experts: int, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] (int) -> (token_of_row [T k] int64: the token each expert-sorted row reads, row_of_pair [T k]
    int32: each (token, slot) pair's row, ends [experts] int32: each expert's run end), with pairs of one expert
    in (token, slot) order: what torch.argsort(ids.flatten(), stable=True) gives. The last `shared` of the
    experts are shared ones, which the last `shared` slots of every token hold in order (TopkRouter's slots):
    those are placed without being sorted."""
    assert triton is not None
    tokens, k = ids.shape
    pairs = tokens * k
    assert pairs <= ALIGN_MAX_PAIRS, pairs
    assert 0 <= shared < k and shared <= experts, (shared, k, experts)
    flat = ids.reshape(-1).to(torch.int32)
    token_of_row = torch.empty(pairs, dtype=torch.int64, device=ids.device)
    row_of_pair = torch.empty(pairs, dtype=torch.int32, device=ids.device)
    ends = torch.empty(experts, dtype=torch.int32, device=ids.device)
    routed = experts - shared
    block = min(ALIGN_BLOCKS[1], max(ALIGN_BLOCKS[0], triton.next_power_of_2(tokens * (k - shared))))
    _align[(1,)](
        flat,
        token_of_row,
        row_of_pair,
        ends,
        tokens,
        K=k - shared,
        SHARED=shared,
        EXPERTS=routed,
        EXPERTS_PAD=triton.next_power_of_2(routed),
        BLOCK=block,
        num_warps=8 if block >= 256 else 4,
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


def route(
    x: torch.Tensor, gate: torch.Tensor, k: int, softmax: bool, normalize: bool, scaling: float, shared: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] (any float dtype), gate [experts, hidden] float32 -> (ids [T, k + shared] int64, weights
    [T, k + shared] float32): each token's k best experts by softmax (or sigmoid) scores of x . gate in float32,
    best first, their scores as weights, renormalised to sum 1 when `normalize`, times `scaling`; then the
    `shared` experts, ids experts.. experts + shared - 1, at weight 1."""
    assert triton is not None
    tokens, hidden = x.shape
    experts = gate.shape[0]
    assert tokens <= ROUTE_MAX_TOKENS and gate.dtype == torch.float32 and gate.shape[1] == hidden, gate.shape
    assert gate.is_contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = torch.empty(tokens, k + shared, dtype=torch.int64, device=x.device)
    weights = torch.empty(tokens, k + shared, dtype=torch.float32, device=x.device)
    if tokens:
        experts_pad = max(16, triton.next_power_of_2(experts))
        block_e = min(experts_pad, ROUTE_BLOCK_E)
        steps = triton.cdiv(triton.cdiv(hidden, ROUTE_BLOCK_H), ROUTE_MAX_SLICES)  # V3's 7168: 4 steps, 28 slices
        slices = triton.cdiv(hidden, ROUTE_BLOCK_H * steps)
        token_blocks = triton.cdiv(tokens, ROUTE_BLOCK_T)
        partial = torch.empty(slices, tokens, experts_pad, dtype=torch.float32, device=x.device)
        _route_logits[(token_blocks, slices, experts_pad // block_e)](
            x,
            gate,
            partial,
            tokens,
            x.stride(0),
            HIDDEN=hidden,
            EXPERTS=experts,
            EXPERTS_PAD=experts_pad,
            BLOCK_T=ROUTE_BLOCK_T,
            BLOCK_H=ROUTE_BLOCK_H,
            BLOCK_E=block_e,
            STEPS=steps,
            num_warps=4,
        )
        _route_pick[(token_blocks,)](
            partial,
            ids,
            weights,
            tokens,
            float(scaling),
            SLICES=slices,
            EXPERTS=experts,
            EXPERTS_PAD=experts_pad,
            K=k,
            SHARED=shared,
            K_PAD=max(2, triton.next_power_of_2(k + shared)),
            SOFTMAX=softmax,
            NORMALIZE=normalize,
            BLOCK_T=ROUTE_BLOCK_T,
            num_warps=4,
        )
    return ids, weights
