"""Multi-head latent attention (MLA) over the paged latent pool in plain PyTorch (SDPA): the CPU path, exact
against transformers in float32 (not graph-safe: its decode gathers rows padded to the longest, sized on the
host). On CUDA mla_triton.py keeps its prefill and replaces its decode attention by a kernel.

A layer's pool view is [blocks, block_size, 1, kv_lora_rank + rope_dim]: per token the normalized latent c
and the rotated rope key k_pe, shared by every head. kv_b_proj expands c into each head's k_nope and v.
- Prefill (a chunk, with or without a cached prefix): the context's latents are expanded into per-head K/V
  (k = [k_nope, k_pe], v) and attended with causal SDPA, as transformers does.
- Decode (absorbed): q_nope is folded into W_UK (q_lat = q_nope W_UK, one r-vector per head), so scores are
  [q_lat, q_pe] . [c, k_pe], read straight off the pool, and the output is the attention-weighted latent
  taken through W_UV: per-head K/V are never formed, and a decode step reads r + rope values per token.
An fp8 pool (attention/kv_quant.py) is dequantised as it is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from rank_worker.model.attention import kv_quant
from rank_worker.model.attention.backend import AttentionBackend
from rank_worker.model.attention.mla_windows import attention_with_lse, context_range, needs_windows, windowed_prefill
from rank_worker.model.attention.sdpa_backend import plan_decode_tables
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice


class MlaSdpaAttention(AttentionBackend):
    name = "mla_sdpa"
    prefix_expands = True  # a chunk's context latents become per-head K/V: bounded by context_window_tokens

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
        raise TypeError("MLA attends through attend_mla: its pool holds latents, not per-head K/V")

    def attend_mla(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        latent_cache: torch.Tensor,
        kv_b_proj: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated); latent: this step's [T, r + rope], already in the
        pool; latent_cache: one layer's [blocks, block_size, 1, r + rope]; kv_b_proj [H * (nope + v), r].
        Returns [T, H, v]."""
        heads, nope = q_nope.shape[1], q_nope.shape[2]
        rank = kv_b_proj.shape[1]
        w_kv = kv_b_proj.view(heads, -1, rank)  # [H, nope + v, r]
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
        out = q_nope.new_empty(q_nope.shape[0], heads, w_uv.shape[1])
        n = batch.num_decodes
        if n:
            # per-head products as batched GEMMs over strided views: q_nope folded into W_UK ([b, h, r], a view of
            # the [h, b, r] product), and o_lat through W_UV written straight into out's rows (cuBLAS takes the
            # [h, b, v] view's strides: no product tensor to copy over, as `out[:n] = einsum(...)` had)
            q_lat = torch.bmm(q_nope[:n].transpose(0, 1), w_uk).transpose(0, 1)
            o_lat = self.decode_latent(q_lat, q_pe[:n], latent_cache, batch, scale)
            torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out[:n].transpose(0, 1))
        if batch.prefills:
            self.prefill_chunks(MlaPrefill(q_nope, q_pe, latent, latent_cache, kv_b_proj, batch, scale), out)
        return out

    def prefill_chunks(self, step: MlaPrefill, out: torch.Tensor) -> None:
        """The step's prefill chunks, each over its context's latents expanded into per-head K/V, into out."""
        for piece in step.batch.prefills:
            rows = slice(piece.token_start, piece.token_start + piece.num_new)
            if needs_windows(piece, self.context_window_tokens):
                out[rows] = self.windowed(piece, step)
                continue
            k, v = step.expand(step.context(piece, 0, piece.context_len))
            if piece.context_len == piece.num_new:
                mask, causal = None, True  # nothing cached before this chunk
            else:
                mask, causal = causal_lower_right(piece.num_new, piece.context_len), False
            q = torch.cat([step.q_nope[rows], step.q_pe[rows]], dim=-1)
            qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=step.scale)
            out[rows] = o.squeeze(0).transpose(0, 1)

    def windowed(self, piece: PrefillSlice, step: MlaPrefill) -> torch.Tensor:
        """A chunk whose context is past context_window_tokens, a window of it at a time (mla_windows.py): [n, H, v]."""
        assert self.context_window_tokens is not None
        rows = slice(piece.token_start, piece.token_start + piece.num_new)
        return windowed_prefill(
            piece,
            torch.cat([step.q_nope[rows], step.q_pe[rows]], dim=-1),
            step.expand,
            lambda start, end: step.context(piece, start, end),
            self.context_window_tokens,
            self.window_attention,
            step.scale,
        )

    def window_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """mla_windows.WindowAttention: PyTorch's here (SDPA gives no log-sum-exp), FA4's in MlaTritonAttention."""
        return attention_with_lse(q, k, v, scale, causal)

    def decode_latent(
        self, q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, batch: ForwardBatch, scale: float
    ) -> torch.Tensor:
        """The decode rows in latent space: q_lat [B, H, r] (q_nope W_UK), q_pe [B, H, rope] over each row's
        [c, k_pe] in the pool -> [B, H, r], the attention-weighted latents (W_UV is applied after)."""
        return _absorbed_decode(q_lat, q_pe, latent_cache, batch, scale)


@dataclass
class MlaPrefill:
    """What a step's MLA prefill reads: q_nope [T, H, nope], q_pe [T, H, rope] (rotated), this step's latents
    [T, r + rope] (already in the pool), one layer's pool view, kv_b_proj [H * (nope + v), r], the batch, the
    softmax scale."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    latent: torch.Tensor
    latent_cache: torch.Tensor
    kv_b_proj: torch.Tensor
    batch: ForwardBatch
    scale: float

    def context(self, piece: PrefillSlice, start: int, end: int) -> torch.Tensor:
        """A chunk's context latents [start, end) in the model's dtype (mla_windows.context_range)."""
        return context_range(piece, start, end, self.latent, self.latent_cache, self.batch, self.q_nope.dtype)

    def expand(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context latents -> per-head (k, v) (expand_latents)."""
        return expand_latents(context, self.kv_b_proj, self.q_nope.shape[1], self.q_nope.shape[2])


def expand_latents(context: torch.Tensor, kv_b_proj: torch.Tensor, heads: int, nope: int) -> tuple:
    """Context latents [m, r + rope] -> per-head k [m, H, nope + rope] (k_pe shared by every head) and v [m, H, v]
    (a view into kv_b_proj's output)."""
    rank = kv_b_proj.shape[1]
    c, k_pe = context[:, :rank], context[:, rank:]
    kv = F.linear(c, kv_b_proj).view(context.shape[0], heads, -1)
    k = torch.cat([kv[..., :nope], k_pe.unsqueeze(1).expand(-1, heads, -1)], dim=-1)
    return k, kv[..., nope:]


def _absorbed_decode(
    q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """One query token per sequence over its whole context, in latent space; sequences padded to the longest
    and masked. Returns [B, H, r]."""
    assert batch.decode_lens is not None
    block_size = latent_cache.shape[1]
    rank = q_lat.shape[2]
    lens = batch.decode_lens.long()
    max_blocks = -(-int(lens.max()) // block_size)
    tables = batch.attention[:, :max_blocks].long()
    num_seqs = tables.shape[0]
    keys = kv_quant.dequantize(latent_cache[tables], q_lat.dtype).reshape(
        num_seqs, 1, max_blocks * block_size, latent_cache.shape[-1]
    )  # [B, 1, S, r+rope]
    positions = torch.arange(max_blocks * block_size, device=q_lat.device)
    mask = (positions.unsqueeze(0) < lens.unsqueeze(1)).view(num_seqs, 1, 1, -1)
    query = torch.cat([q_lat, q_pe], dim=-1).unsqueeze(2)  # [B, H, 1, r + rope]
    heads = query.shape[1]
    # One latent head for all query heads (MQA in latent space); values are the latents' first r dims.
    k = keys.expand(-1, heads, -1, -1)
    v = keys[..., :rank].expand(-1, heads, -1, -1)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale).squeeze(2)  # [B, H, r]
