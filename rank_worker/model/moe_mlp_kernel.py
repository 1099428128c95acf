"""The routed experts' MLP for decode-sized batches as two Triton kernels over the expert-sorted rows of
moe_kernels.align: gate/up with SiLU x up in its epilogue, then down.

A decode step of a MoE model is a weight read: at 16 rows of V2-Lite ~51 of the 64 experts are hit, ~880 MB a
layer. torch._grouped_mm's CUTLASS kernels reached ~60% of the H200's bandwidth there, tuned for rows by the
hundred. Here a program takes BLOCK_M rows of one expert (a partial block at each expert's end, none for an expert
not hit) and BLOCK_N of its output columns, and streams that slice of the expert's weights once: the grid is
(blocks, column tiles), its first size bounded by the pair count alone (cdiv(pairs, BLOCK_M) + min(experts, pairs)),
so one CUDA graph per batch size serves any routing. Which block is whose is found in the kernel from align's run
ends (a prefix sum over the experts), and the gate/up kernel gathers each row's token from x itself: no padded index
lists, no index_select pass.

Rounding as the unfused path: gate and up rounded to the model's dtype, SiLU rounded, then the product.
"""

from __future__ import annotations

import torch

from rank_worker.model.fused_ops import triton

# Launch shape, per kernel: rows per program (tl.dot's smallest M), output columns, the reduction step, warps
# and pipeline depth. Chosen on the H200 by bench/probes/moe_probe.py:
# up to 128 tokens of V2-Lite with uniform routing these were within 2% of the sweep's best (81-85% of HBM
# bandwidth); past ~1,000 pairs (a row block of 16 reads an expert's weights twice or more) 32-row programs
# were 10-20% faster with uniform routing and ~40% with every token on the same experts.
GATE_UP = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
DOWN = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
MANY_PAIRS = 1024
GATE_UP_MANY = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
DOWN_MANY = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _block_rows(block, ends_ptr, EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        """Program `block`'s expert and its rows [start, end) of the sorted pairs; end <= start past the last
        block (experts' blocks are laid out in expert order, each expert's runs cut into BLOCK_M rows)."""
        e = tl.arange(0, EXPERTS_PAD)
        ends = tl.load(ends_ptr + e, mask=e < EXPERTS, other=0)
        starts = tl.load(ends_ptr + e - 1, mask=(e >= 1) & (e < EXPERTS), other=0)
        blocks = (ends - starts + BLOCK_M - 1) // BLOCK_M
        after = tl.cumsum(blocks, axis=0)  # blocks of the experts up to and including e
        expert = tl.sum((after <= block).to(tl.int32), axis=0)
        mine = e == expert
        first = tl.sum(tl.where(mine, after - blocks, 0), axis=0)
        start = tl.sum(tl.where(mine, starts, 0), axis=0) + (block - first) * BLOCK_M
        end = tl.minimum(tl.sum(tl.where(mine, ends, 0), axis=0), start + BLOCK_M)
        return expert, start, end

    @triton.jit
    def _gate_up_silu(
        x_ptr,
        w_ptr,
        token_of_row_ptr,
        ends_ptr,
        act_ptr,
        hidden,
        inter,
        EXPERTS: tl.constexpr,
        EXPERTS_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """act[row, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, inter + n]) for the block's rows (w is
        [experts, 2 inter, hidden], gate rows then up rows, as MoE.experts_gate_up)."""
        expert, start, end = _block_rows(tl.program_id(0), ends_ptr, EXPERTS, EXPERTS_PAD, BLOCK_M)
        if start < end:
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            tokens = tl.load(token_of_row_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < inter
            w = w_ptr + expert.to(tl.int64) * 2 * inter * hidden
            gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < hidden
                a = tl.load(
                    x_ptr + tokens[:, None] * hidden + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
                )
                w_mask = k_ok[:, None] & col_ok[None, :]
                w_gate = tl.load(w + cols[None, :].to(tl.int64) * hidden + ks[:, None], mask=w_mask, other=0.0)
                w_up = tl.load(w + (cols[None, :] + inter).to(tl.int64) * hidden + ks[:, None], mask=w_mask, other=0.0)
                gate = tl.dot(a, w_gate, gate)
                up = tl.dot(a, w_up, up)
            dtype = act_ptr.dtype.element_ty
            g = gate.to(dtype).to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
            tl.store(
                act_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :], act, row_ok[:, None] & col_ok[None, :]
            )

    @triton.jit
    def _down(
        act_ptr,
        w_ptr,
        ends_ptr,
        out_ptr,
        inter,
        hidden,
        EXPERTS: tl.constexpr,
        EXPERTS_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[row, n] = act[row] . w[e, n] (w is [experts, hidden, inter], as MoE.experts_down)."""
        expert, start, end = _block_rows(tl.program_id(0), ends_ptr, EXPERTS, EXPERTS_PAD, BLOCK_M)
        if start < end:
            rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
            row_ok = rows < end
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < hidden
            w = w_ptr + expert.to(tl.int64) * hidden * inter
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < inter
                a = tl.load(
                    act_ptr + rows[:, None] * inter + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
                )
                wt = tl.load(
                    w + cols[None, :].to(tl.int64) * inter + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                acc = tl.dot(a, wt, acc)
            out = acc.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], out, row_ok[:, None] & col_ok[None, :])


def _grid_blocks(pairs: int, experts: int, block_m: int) -> int:
    """Programs along the rows: enough for any routing of `pairs` pairs (each expert hit adds at most one
    partial block)."""
    return triton.cdiv(pairs, block_m) + min(experts, pairs)


def gate_up_silu(
    x: torch.Tensor, gate_up: torch.Tensor, token_of_row: torch.Tensor, ends: torch.Tensor, launch: dict | None = None
) -> torch.Tensor:
    """x [T, hidden], gate_up [E, 2I, hidden] -> act [P, I]: silu(gate) * up of each sorted row's token."""
    assert triton is not None
    experts, double_inter, hidden = gate_up.shape
    inter, pairs = double_inter // 2, token_of_row.numel()
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    if pairs:
        shape = dict(GATE_UP_MANY if pairs > MANY_PAIRS else GATE_UP, **(launch or {}))
        grid = (_grid_blocks(pairs, experts, shape["BLOCK_M"]), triton.cdiv(inter, shape["BLOCK_N"]))
        pad = triton.next_power_of_2(experts)
        _gate_up_silu[grid](
            x.contiguous(), gate_up.contiguous(), token_of_row, ends, act, hidden, inter,
            EXPERTS=experts, EXPERTS_PAD=pad, **shape,
        )  # fmt: skip
    return act


def down(act: torch.Tensor, down_w: torch.Tensor, ends: torch.Tensor, launch: dict | None = None) -> torch.Tensor:
    """act [P, I] (sorted rows), down_w [E, hidden, I] -> [P, hidden]."""
    assert triton is not None
    experts, hidden, inter = down_w.shape
    pairs = act.shape[0]
    out = torch.empty(pairs, hidden, dtype=act.dtype, device=act.device)
    if pairs:
        shape = dict(DOWN_MANY if pairs > MANY_PAIRS else DOWN, **(launch or {}))
        grid = (_grid_blocks(pairs, experts, shape["BLOCK_M"]), triton.cdiv(hidden, shape["BLOCK_N"]))
        pad = triton.next_power_of_2(experts)
        _down[grid](
            act.contiguous(), down_w.contiguous(), ends, out, inter, hidden, EXPERTS=experts, EXPERTS_PAD=pad, **shape
        )
    return out


def expert_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down_w: torch.Tensor,
    token_of_row: torch.Tensor,
    ends: torch.Tensor,
    gate_up_launch: dict | None = None,
    down_launch: dict | None = None,
) -> torch.Tensor:
    """x [T, hidden]; gate_up [E, 2I, hidden]; down_w [E, hidden, I]; token_of_row [P] and ends [E] from
    moe_kernels.align -> [P, hidden]: each sorted row's expert MLP output, in x's dtype (what the grouped GEMMs
    give, unweighted). The launch dicts override GATE_UP / DOWN (the probe's sweep)."""
    return down(gate_up_silu(x, gate_up, token_of_row, ends, gate_up_launch), down_w, ends, down_launch)
