"""Decode attention read in place from the paged pool: a Triton kernel (CUDA only).

The SDPA path gathers every row's blocks into a padded copy first: a step pays for every row as if it
were as long as the longest (8 rows beside one 48K-token session cost 131 ms per step on the H200),
and the copy itself doubles the bytes moved. Here each program reads one kv head's K/V for one slice
of one sequence straight from its blocks, for all the query heads that share that kv head (GQA), with
an online softmax; slices past a row's length exit at once, so a step costs the tokens it really has.
Partial results of the slices are merged afterwards (split-K, as flash-decoding does), which keeps the
GPU busy when few sequences are long.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None
    tl = None

TILE_TOKENS = 64  # tokens scored per loop iteration
PARTITION_TOKENS = 512  # tokens per program (one split-K slice)


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def use_kernel(setting: str, on_cuda: bool, head_dim: int) -> bool:
    """Resolve the decode_attention setting: "auto" takes the kernel wherever it can run."""
    fits = on_cuda and available() and head_dim >= 16 and head_dim & (head_dim - 1) == 0
    if setting == "triton" and not fits:
        raise RuntimeError("decode_attention: triton needs CUDA, Triton and a power-of-two head_dim >= 16")
    return fits and setting != "sdpa"


if triton is not None:

    @triton.jit
    def _decode_slices(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
        out_ptr,
        lse_ptr,
        stride_q_seq,
        stride_q_head,
        stride_kv_block,
        stride_kv_token,
        stride_kv_head,
        stride_table_seq,
        num_slices,
        scale,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        SLICE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        piece = tl.program_id(2)
        length = tl.load(lens_ptr + seq).to(tl.int32)
        rows = tl.arange(0, GROUP_PAD)
        row_ok = rows < GROUP
        heads = kv_head * GROUP + rows
        dims = tl.arange(0, HEAD_DIM)
        num_heads = tl.num_programs(1) * GROUP
        # partial outputs: [seq, head, slice, dim]; log-sum-exps: [seq, head, slice]
        lse_at = lse_ptr + (seq * num_heads + heads) * num_slices + piece
        out_at = out_ptr + ((seq * num_heads + heads) * num_slices + piece)[:, None] * HEAD_DIM + dims[None, :]
        start = piece * SLICE
        if start >= length:
            tl.store(lse_at, tl.full([GROUP_PAD], float("-inf"), tl.float32), mask=row_ok)
            tl.store(out_at, tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32), mask=row_ok[:, None])
            return
        q = tl.load(
            q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :], mask=row_ok[:, None], other=0.0
        )
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        offsets = tl.arange(0, TILE)
        end = tl.minimum(length, start + SLICE)
        for tile_start in range(start, end, TILE):
            tokens = tile_start + offsets
            valid = tokens < end
            blocks = tl.load(tables_ptr + seq * stride_table_seq + tokens // BLOCK_SIZE, mask=valid, other=0)
            row_at = blocks.to(tl.int64) * stride_kv_block + (tokens % BLOCK_SIZE) * stride_kv_token
            at = row_at[:, None] + kv_head * stride_kv_head + dims[None, :]
            k = tl.load(k_ptr + at, mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            weights = tl.exp(scores - new_best[:, None])
            rescale = tl.exp(best - new_best)
            total = total * rescale + tl.sum(weights, 1)
            v = tl.load(v_ptr + at, mask=valid[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        tl.store(lse_at, best + tl.log(total), mask=row_ok)
        tl.store(out_at, acc / total[:, None], mask=row_ok[:, None])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [S, Hq, D] (one token per sequence); k_cache/v_cache one layer's [blocks, block_size, Hkv, D] views
    of the pool; block_tables [S, max_blocks]; context_lens [S] (>= 1). Returns [S, Hq, D] in q's dtype."""
    assert triton is not None, "the Triton decode kernel needs triton (CUDA builds of torch ship it)"
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    num_slices = triton.cdiv(block_tables.shape[1] * block_size, PARTITION_TOKENS)
    partial = torch.empty(num_seqs, num_heads, num_slices, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_seqs, num_heads, num_slices, dtype=torch.float32, device=q.device)
    _decode_slices[(num_seqs, num_kv_heads, num_slices)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        partial,
        lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_slices,
        scale,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=TILE_TOKENS,
        SLICE=PARTITION_TOKENS,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # full fp32 products for fp32 models
    )
    # Merge the slices: each weighs by its share of the softmax mass (empty slices have lse -inf).
    weights = torch.softmax(lse, dim=-1)
    return (partial * weights.unsqueeze(-1)).sum(dim=2).to(q.dtype)
