"""Decode attention read in place from the paged pool: a Triton kernel (CUDA only).

Gathering every row's blocks into a padded copy makes a step pay for every row as if it were as long as
the longest (8 rows beside one 48K-token session cost 131 ms per step on the H200) and doubles the bytes
moved. Here each program reads one kv head's K/V for one slice of one sequence straight from its blocks,
for all the query heads that share that kv head (GQA), with an online softmax. Each row is cut into the
same number of slices whatever its length (split-K, as flash-decoding does), so the launch grid depends on
the batch size alone and one CUDA graph per batch size serves every context length; a second small kernel
merges the slices by their share of the softmax mass.

Rows find their blocks through `rows`, an index into the persistent block-table buffer (block_tables.py),
which is updated in place as sequences grow rather than rebuilt every step.
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
MAX_SLICES = 32
# Programs per launch the slices aim for (~31 per multiprocessor of the H200). Many more than fit at once: a
# row's slices are as long as the row, so with few slices a long row's programs are the step's tail: 4096
# against 1024 programs took 9-14% off steps of uneven rows (H200, llama-8b) and cost uniform rows 1-4%.
TARGET_PROGRAMS = 4096
MERGE_DIMS = 128  # a head's dims merged by one program (a power of two)
MERGE_SLICES = 32  # slices a merge program weighs at a time (a power of two)


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def slices_for(batch: int, num_kv_heads: int, target: int = TARGET_PROGRAMS, most: int = MAX_SLICES) -> int:
    """Slices per row (a power of two) for about `target` programs, at most `most`: few rows or kv heads need
    more of them to fill the GPU; many need none."""
    wanted = max(1, min(most, target // max(1, batch * num_kv_heads)))
    return 1 << (wanted.bit_length() - 1)


if triton is not None:

    @triton.jit
    def _decode_slices(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        rows_ptr,
        lens_ptr,
        out_ptr,
        lse_ptr,
        stride_q_seq,
        stride_q_head,
        stride_kv_block,
        stride_kv_token,
        stride_kv_head,
        stride_table_row,
        scale,
        NUM_SLICES: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        piece = tl.program_id(2)
        length = tl.load(lens_ptr + seq).to(tl.int32)
        table = tables_ptr + tl.load(rows_ptr + seq).to(tl.int64) * stride_table_row
        heads_in_group = tl.arange(0, GROUP_PAD)
        row_ok = heads_in_group < GROUP
        heads = kv_head * GROUP + heads_in_group
        dims = tl.arange(0, HEAD_DIM)
        num_heads = tl.num_programs(1) * GROUP
        # partial outputs: [seq, head, slice, dim]; log-sum-exps: [seq, head, slice]
        lse_at = lse_ptr + (seq * num_heads + heads) * NUM_SLICES + piece
        out_at = out_ptr + ((seq * num_heads + heads) * NUM_SLICES + piece)[:, None] * HEAD_DIM + dims[None, :]
        # Every row is cut into NUM_SLICES tile-aligned slices of its own length.
        per_slice = tl.cdiv(tl.cdiv(length, NUM_SLICES), TILE) * TILE
        start = piece * per_slice
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
        end = tl.minimum(length, start + per_slice)
        for tile_start in range(start, end, TILE):
            tokens = tile_start + offsets
            valid = tokens < end
            blocks = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0)
            row_at = blocks.to(tl.int64) * stride_kv_block + (tokens % BLOCK_SIZE) * stride_kv_token
            at = row_at[:, None] + kv_head * stride_kv_head + dims[None, :]
            k = tl.load(k_ptr + at, mask=valid[:, None], other=0.0).to(q.dtype)  # fp8 pool: its value (scale 1)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            weights = tl.exp(scores - new_best[:, None])
            rescale = tl.exp(best - new_best)
            total = total * rescale + tl.sum(weights, 1)
            v = tl.load(v_ptr + at, mask=valid[:, None], other=0.0).to(q.dtype)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        tl.store(lse_at, best + tl.log(total), mask=row_ok)
        tl.store(out_at, acc / total[:, None], mask=row_ok[:, None])

    @triton.jit
    def _merge_slices(
        partial_ptr,
        lse_ptr,
        out_ptr,
        stride_out_seq,
        NUM_SLICES: tl.constexpr,
        SLICE_CHUNK: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_BLOCK: tl.constexpr,
    ):
        """One (sequence, head, DIM_BLOCK dims): the slices' outputs weighted by their share of the softmax mass,
        SLICE_CHUNK slices at a time (hundreds of slices would not fit a program's registers at once). An empty
        slice (lse -inf) has weight 0 and its partial is not read (it need not have been written)."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        num_heads = tl.num_programs(1)
        pieces = tl.arange(0, NUM_SLICES)
        dims = tl.program_id(2) * DIM_BLOCK + tl.arange(0, DIM_BLOCK)
        base = seq * num_heads + head
        lse_all = tl.load(lse_ptr + base * NUM_SLICES + pieces)
        top = tl.max(lse_all, 0)
        mass = tl.sum(tl.exp(lse_all - top), 0)  # empty slices: exp(-inf) = 0
        merged = tl.zeros([DIM_BLOCK], tl.float32)
        chunk = tl.arange(0, SLICE_CHUNK)
        for first in tl.static_range(0, NUM_SLICES, SLICE_CHUNK):
            lse = tl.load(lse_ptr + base * NUM_SLICES + first + chunk)
            filled = lse > float("-inf")
            weights = tl.exp(lse - top) / mass
            at = (base * NUM_SLICES + first + chunk)[:, None] * HEAD_DIM + dims[None, :]
            partial = tl.load(partial_ptr + at, mask=filled[:, None], other=0.0)
            merged += tl.sum(partial * weights[:, None], 0)
        tl.store(out_ptr + seq * stride_out_seq + head * HEAD_DIM + dims, merged.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [S, Hq, D] (one token per sequence); k_cache/v_cache one layer's [blocks, block_size, Hkv, D] views
    of the pool; block_tables [table rows, max_blocks] (int32), rows [S] the table row of each sequence,
    context_lens [S] (>= 1). Writes into `out` ([S, Hq, D], q's dtype) when given; returns it."""
    assert triton is not None, "the Triton decode kernel needs triton (CUDA builds of torch ship it)"
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    num_slices = slices_for(num_seqs, num_kv_heads)
    partial = torch.empty(num_seqs, num_heads, num_slices, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_seqs, num_heads, num_slices, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty_like(q)
    if not num_seqs:
        return out
    _decode_slices[(num_seqs, num_kv_heads, num_slices)](
        q,
        k_cache,
        v_cache,
        block_tables,
        rows,
        context_lens,
        partial,
        lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        scale,
        NUM_SLICES=num_slices,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=TILE_TOKENS,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # full fp32 products for fp32 models
    )
    merge_slices(partial, lse, out)
    return out


def merge_slices(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """out [S, H, D] = the slices' partial outputs [S, H, slices, D] (float32) weighted by their share of the
    softmax mass, from their log-sum-exps lse [S, H, slices] (-inf for an empty slice, whose partial is not
    read). A program merges MERGE_DIMS of a head's dims, MERGE_SLICES slices at a time: MLA's 512-wide latent
    over hundreds of slices would not fit one program's registers."""
    num_seqs, num_heads, num_slices, head_dim = partial.shape
    assert out.stride(2) == 1 and out.stride(1) == head_dim
    dim_block = min(head_dim, MERGE_DIMS)
    assert head_dim % dim_block == 0, (head_dim, dim_block)
    grid = (num_seqs, num_heads, head_dim // dim_block)
    chunk = min(num_slices, MERGE_SLICES)
    _merge_slices[grid](
        partial,
        lse,
        out,
        out.stride(0),
        NUM_SLICES=num_slices,
        SLICE_CHUNK=chunk,
        HEAD_DIM=head_dim,
        DIM_BLOCK=dim_block,
    )
