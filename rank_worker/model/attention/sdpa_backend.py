"""Attention over the paged KV pool in plain PyTorch (SDPA): the CPU backend, exact against transformers in
float32. Each sequence's blocks are gathered into a contiguous copy first; decode rows are padded to the
longest and masked. An fp8 pool (attention/kv_quant.py) is dequantised as it is gathered, and a chunk's own
K/V are attended as the pool holds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from rank_worker.model.attention import kv_quant
from rank_worker.model.attention.backend import AttentionBackend
from rank_worker.model.forward_batch import ForwardBatch


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
) -> None:
    """Store this step's K/V ([T, Hkv, D]) at their slots (quantised in an fp8 pool); k_cache/v_cache are one
    layer's views."""
    kv_quant.store(k_cache, batch.slot_blocks, batch.slot_offsets, k)
    kv_quant.store(v_cache, batch.slot_blocks, batch.slot_offsets, v)


def plan_decode_tables(batch: ForwardBatch) -> None:
    """The decode rows' block tables, picked out of the persistent table once per step (not per layer)."""
    batch.attention = None
    if batch.num_decodes:
        assert batch.decode_rows is not None
        batch.attention = batch.block_tables[batch.decode_rows.long()]


class SdpaAttention(AttentionBackend):
    name = "sdpa"

    def plan(self, batch: ForwardBatch) -> None:
        plan_decode_tables(batch)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        n = batch.num_decodes
        # fp8 pool: the chunk attends to its own K/V as stored, as a later chunk over this prefix will.
        k, v = kv_quant.round_trip(k, k_cache), kv_quant.round_trip(v, v_cache)
        if n:
            out[:n] = _decode_attention(q[:n], k_cache, v_cache, batch, scale)
        for piece in batch.prefills:
            rows = slice(piece.token_start, piece.token_start + piece.num_new)
            if piece.context_len == piece.num_new:
                # Nothing cached before this chunk: attend to its own K/V, plain causal (flash-friendly).
                out[rows] = causal_sdpa(q[rows], k[rows], v[rows], scale)
            else:
                table = batch.block_tables[piece.table_row, : -(-piece.context_len // block_size)].long()
                keys = kv_quant.dequantize(_gather_sequence(k_cache, table, piece.context_len), q.dtype)
                values = kv_quant.dequantize(_gather_sequence(v_cache, table, piece.context_len), q.dtype)
                mask = causal_lower_right(piece.num_new, piece.context_len)
                out[rows] = _sdpa(q[rows], keys, values, scale, mask=mask)
        return out


def _gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    blocks = cache[block_table]  # [nb, bs, H, D]
    return blocks.reshape(-1, *blocks.shape[2:])[:length]


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk attending to its own K/V only (nothing cached before it): plain causal, flash-friendly."""
    return _sdpa(q, k, v, scale, causal=True)


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
    assert batch.decode_lens is not None
    block_size = k_cache.shape[1]
    lens = batch.decode_lens.long()
    max_blocks = -(-int(lens.max()) // block_size)
    tables = batch.attention[:, :max_blocks].long()
    num_seqs = tables.shape[0]
    padded = (num_seqs, max_blocks * block_size, *k_cache.shape[2:])
    keys = kv_quant.dequantize(k_cache[tables], q.dtype).reshape(padded)
    values = kv_quant.dequantize(v_cache[tables], q.dtype).reshape(padded)
    positions = torch.arange(max_blocks * block_size, device=q.device)
    mask = (positions.unsqueeze(0) < lens.unsqueeze(1)).view(num_seqs, 1, 1, -1)
    qh = q.unsqueeze(2)  # [B, Hq, 1, D]
    kh, vh = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, S, D]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=qh.shape[1] != kh.shape[1])
    return o.squeeze(2)
