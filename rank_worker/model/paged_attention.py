"""Attention over the paged KV pool, in plain PyTorch (SDPA), for CPU and CUDA alike; on CUDA decode
rows can instead be read in place by a Triton kernel (paged_decode_kernel.py).

The pool is one tensor [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]: a physical block
holds every layer's K and V for its tokens contiguously, so it can be copied to host memory in one piece.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from rank_worker.model.forward_batch import ForwardBatch
from rank_worker.model.paged_decode_kernel import paged_decode_attention


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
) -> None:
    """Store this step's K/V ([T, Hkv, D]) at their slots; k_cache/v_cache are one layer's views."""
    k_cache[batch.slot_blocks, batch.slot_offsets] = k
    v_cache[batch.slot_blocks, batch.slot_offsets] = v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: this step's [T, Hkv, D] (already written to the cache). Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    if batch.decode is not None:
        n = batch.decode.num_seqs
        out[:n] = _decode_attention(q[:n], k_cache, v_cache, batch, scale)
    for piece in batch.prefills:
        rows = slice(piece.token_start, piece.token_start + piece.num_new)
        if piece.context_len == piece.num_new:
            # Nothing cached before this chunk: attend to its own K/V, plain causal (flash-friendly).
            out[rows] = _sdpa(q[rows], k[rows], v[rows], scale, causal=True)
        else:
            keys = _gather_sequence(k_cache, piece.block_table, piece.context_len)
            values = _gather_sequence(v_cache, piece.block_table, piece.context_len)
            mask = causal_lower_right(piece.num_new, piece.context_len)
            out[rows] = _sdpa(q[rows], keys, values, scale, mask=mask)
    return out


def _gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    blocks = cache[block_table]  # [nb, bs, H, D]
    return blocks.reshape(-1, *blocks.shape[2:])[:length]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False, mask: object = None
) -> torch.Tensor:
    """Single-sequence attention: q [n, Hq, D], k/v [m, Hkv, D] -> [n, Hq, D]."""
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=qh.shape[1] != kh.shape[1]
    )
    return o.squeeze(0).transpose(0, 1)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """One query token per sequence over its whole context; sequences padded to the longest."""
    group = batch.decode
    assert group is not None
    if group.paged_kernel:
        return paged_decode_attention(q, k_cache, v_cache, group.block_tables, group.context_lens, scale)
    num_seqs, max_blocks = group.block_tables.shape
    block_size = k_cache.shape[1]
    keys = k_cache[group.block_tables].reshape(num_seqs, max_blocks * block_size, *k_cache.shape[2:])
    values = v_cache[group.block_tables].reshape(num_seqs, max_blocks * block_size, *v_cache.shape[2:])
    positions = torch.arange(max_blocks * block_size, device=q.device)
    mask = (positions.unsqueeze(0) < group.context_lens.unsqueeze(1)).view(num_seqs, 1, 1, -1)
    qh = q.unsqueeze(2)  # [B, Hq, 1, D]
    kh, vh = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, S, D]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=qh.shape[1] != kh.shape[1])
    return o.squeeze(2)
