"""Prefill attention over a cached prefix, read in place from the paged pool: a Triton kernel (CUDA only).

Every prefill chunk of a step in one launch: each program takes BLOCK_M new tokens of one chunk for one query
head and runs a flash-attention loop (online softmax, exp2) over that sequence's keys, block-table lookups
instead of a gathered copy of the prefix: the SDPA path copied a 100K-token prefix per layer (two 1.6 GB
gathers for an 8B model) and then ran with an explicit mask, off the flash path. The keys below the tile's
first position are visible to all of its rows and run unmasked; only the diagonal tiles are masked.

The chunk's own K/V are in the pool already (the rotary kernel stores them before attention), so a plain
prefill (nothing cached) is the same kernel with an empty prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None
    tl = None


def block_m_for(dtype: torch.dtype) -> int:
    """Query rows per program: 128 for 16-bit models (wgmma tiles); float32 tiles must fit shared memory."""
    return 32 if dtype == torch.float32 else 128


# Whether a program packs a kv head's whole GQA group (rows = tokens x heads) instead of one query head:
# measured slightly slower on the H200 (8K over 32K: 12.1 ms packed, 11.7 ms per head), so off.
PACK_GQA = False


def tile_tokens(dtype: torch.dtype, group: int, pack: bool = PACK_GQA) -> int:
    """New tokens per program."""
    rows = block_m_for(dtype)
    return max(1, rows // group) if pack and group <= rows else rows


@dataclass(frozen=True)
class KernelConfig:
    block_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int
    warp_specialize: bool = False


# Chosen by measurement (bench/probes/attention_kernels.py on the H200, one llama-8b layer, 8K new over a
# 32K prefix): of BLOCK_N 32/64/128 x 4/8 warps x 2-4 stages, 128 keys, 8 warps and 3 stages was fastest
# for bf16 (11.7 ms; 64 keys: 12.7 ms). float32 tiles (tests) need less shared memory.
CONFIGS = {
    torch.bfloat16: KernelConfig(128, 8, 3),
    torch.float16: KernelConfig(128, 8, 3),
    torch.float32: KernelConfig(32, 4, 2),
}


if triton is not None:

    @triton.jit
    def _tile(
        q,
        k_ptr,
        v_ptr,
        table,
        key_start,
        context,
        query_pos,
        kv_offset,
        best,
        total,
        acc,
        qk_scale,
        stride_kv_block,
        stride_kv_token,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """One key tile of the online softmax: scores, running max and sum, the weighted values."""
        keys = key_start + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM)
        if MASKED:
            valid = keys < context
            blocks = tl.load(table + keys // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        else:
            blocks = tl.load(table + keys // BLOCK_SIZE).to(tl.int64)
        at = (blocks * stride_kv_block + (keys % BLOCK_SIZE) * stride_kv_token + kv_offset)[:, None] + dims[None, :]
        if MASKED:  # noqa: SIM108 (a constexpr branch: the unmasked tiles compile without predicates)
            k = tl.load(k_ptr + at, mask=valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + at)
        k = k.to(q.dtype)  # an fp8 pool: its values (kv_quant's scale is 1.0); a no-op in the model's dtype
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            visible = valid[None, :] & (keys[None, :] <= query_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        # The running max is kept on raw scores; the scale is folded into exp2's argument (one FMA).
        new_best = tl.maximum(best, tl.max(scores, 1))
        weights = tl.exp2(scores * qk_scale - (new_best * qk_scale)[:, None])
        rescale = tl.exp2((best - new_best) * qk_scale)
        total = total * rescale + tl.sum(weights, 1)
        if MASKED:  # noqa: SIM108
            v = tl.load(v_ptr + at, mask=valid[:, None], other=0.0)
        else:
            v = tl.load(v_ptr + at)
        v = v.to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        return new_best, total, acc

    @triton.jit
    def _prefill_paged(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        tables_ptr,
        tile_piece_ptr,
        tile_m_ptr,
        piece_ptr,  # [pieces, 4]: table row, first flat token, new tokens, context tokens after this step
        stride_q_token,
        stride_q_head,
        stride_out_token,
        stride_out_head,
        stride_kv_block,
        stride_kv_token,
        stride_kv_head,
        stride_table_row,
        qk_scale,  # softmax scale times log2(e): the loop works in exp2
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        PACK_GQA: tl.constexpr,  # one program per kv head: its GROUP query heads share each K/V tile load
        WARP_SPECIALIZE: tl.constexpr,
    ):
        tile = tl.program_id(0)
        head = tl.program_id(1)  # a query head, or with PACK_GQA a kv head
        piece = tl.load(tile_piece_ptr + tile)
        m_start = tl.load(tile_m_ptr + tile)
        table_row = tl.load(piece_ptr + piece * 4).to(tl.int64)
        first_token = tl.load(piece_ptr + piece * 4 + 1)
        num_new = tl.load(piece_ptr + piece * 4 + 2)
        context = tl.load(piece_ptr + piece * 4 + 3)
        prefix = context - num_new
        table = tables_ptr + table_row * stride_table_row
        rows = tl.arange(0, BLOCK_M)
        if PACK_GQA:
            # rows are (token, head of the group) pairs: BLOCK_M // GROUP tokens a tile
            kv_head = head
            m = m_start + rows // GROUP
            row_heads = head * GROUP + rows % GROUP
            m_ok = (m < num_new) & (rows < (BLOCK_M // GROUP) * GROUP)
            tile_tokens = BLOCK_M // GROUP
        else:
            kv_head = head // GROUP
            m = m_start + rows
            row_heads = head + rows * 0
            m_ok = m < num_new
            tile_tokens = BLOCK_M
        dims = tl.arange(0, HEAD_DIM)
        token_rows = (first_token + m).to(tl.int64)
        q = tl.load(
            q_ptr + token_rows[:, None] * stride_q_token + row_heads[:, None] * stride_q_head + dims[None, :],
            mask=m_ok[:, None],
            other=0.0,
        )
        query_pos = prefix + m
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kv_offset = kv_head * stride_kv_head

        # Keys before the tile's first position are visible to every row: no mask.
        unmasked_end = ((prefix + m_start) // BLOCK_N) * BLOCK_N
        for key_start in tl.range(0, unmasked_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            best, total, acc = _tile(
                q, k_ptr, v_ptr, table, key_start, context, query_pos, kv_offset, best, total, acc, qk_scale,
                stride_kv_block, stride_kv_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, False,
            )  # fmt: skip
        # The diagonal: causal mask, and the end of the sequence's keys.
        masked_end = tl.minimum(context, prefix + m_start + tile_tokens)
        for key_start in range(unmasked_end, masked_end, BLOCK_N):
            best, total, acc = _tile(
                q, k_ptr, v_ptr, table, key_start, context, query_pos, kv_offset, best, total, acc, qk_scale,
                stride_kv_block, stride_kv_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, True,
            )  # fmt: skip

        out = acc / total[:, None]
        tl.store(
            out_ptr + token_rows[:, None] * stride_out_token + row_heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_ok[:, None],
        )


def prefill_tiles(pieces: list[tuple[int, int, int, int]], block_m: int) -> tuple[list[int], list[int]]:
    """The launch's tiles for pieces (table row, first token, new tokens, context): (piece, first new-token
    index) each, the longest (last rows of the longest contexts) first so the tail of the launch is short."""
    tiles = [(piece, m) for piece, (_, _, new, _) in enumerate(pieces) for m in range(0, new, block_m)]
    tiles.sort(key=lambda tile: -(pieces[tile[0]][3] - pieces[tile[0]][2] + tile[1]))
    return [piece for piece, _ in tiles], [m for _, m in tiles]


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tile_piece: torch.Tensor,
    tile_m: torch.Tensor,
    piece_info: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    pack: bool = PACK_GQA,
    config: KernelConfig | None = None,
) -> None:
    """q [T, Hq, D] (the step's flat tokens); k_cache/v_cache one layer's [blocks, block_size, Hkv, D] views;
    block_tables [rows, max_blocks] int32; tile_piece/tile_m [tiles] int32 and piece_info [pieces, 4] int32
    from prefill_tiles; writes the prefill rows of out ([T, Hq, D])."""
    assert triton is not None, "the Triton prefill kernel needs triton (CUDA builds of torch ship it)"
    num_tiles = tile_piece.shape[0]
    if not num_tiles:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv_heads
    pack = pack and group <= block_m_for(q.dtype)
    config = config or CONFIGS[q.dtype]
    _prefill_paged[(num_tiles, num_kv_heads if pack else num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        tile_piece,
        tile_m,
        piece_info,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        scale * 1.4426950408889634,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m_for(q.dtype),
        BLOCK_N=config.block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PACK_GQA=pack,
        WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
