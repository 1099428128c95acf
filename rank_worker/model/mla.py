"""A DeepSeek attention layer (multi-head latent attention): the projections, the rotary part, and the write
of each token's latent (kv_a_layernorm(c), rotated k_pe) into the paged pool; the attention itself runs in
attention/mla_sdpa.py (or its kernel subclass). With the kernel backend on CUDA the norm, both rotaries and
the write are one kernel (latent_store.py) instead of eager ops.

The projections of the layer's input, q (or its compression q_a, with q_lora_rank) and kv_a, are one GEMM over
their weights stacked (input_proj): one launch a layer fewer, which a decode step of a few tokens, bound by
launches more than by the bytes, feels. Their outputs are column slices of its product."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rank_worker.model import latent_store
from rank_worker.model.attention import kv_quant
from rank_worker.model.attention.mla_sdpa import MlaSdpaAttention
from rank_worker.model.deepseek_config import DeepseekConfig
from rank_worker.model.forward_batch import ForwardBatch
from rank_worker.model.llama import RMSNorm
from rank_worker.model.moe import empty_param
from rank_worker.model.yarn_rope import DeepseekRotary, softmax_scale


class LatentAttention(nn.Module):
    def __init__(self, cfg: DeepseekConfig, rotary: DeepseekRotary) -> None:
        super().__init__()
        self.cfg = cfg
        heads = cfg.num_heads
        # rows of input_proj: q's (q_proj, or q_a_proj with q compression), then kv_a_proj_with_mqa's
        self.q_rows = heads * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank
        self.input_proj = empty_param(self.q_rows + cfg.latent_dim, cfg.hidden_size)
        if cfg.q_lora_rank is None:
            self.q_a_layernorm = None
            self.q_b_proj: torch.Tensor | None = None
        else:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers' default eps, not rms_norm_eps
            self.q_b_proj = empty_param(heads * cfg.qk_head_dim, cfg.q_lora_rank)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = empty_param(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        self.o_proj = empty_param(cfg.hidden_size, heads * cfg.v_head_dim)
        self.rotary = rotary
        self.scale = softmax_scale(cfg.qk_head_dim, cfg.rope_scaling)
        self.backend = MlaSdpaAttention()
        self.fused = False  # norms, rotaries and the latent's store by kernels (CUDA, the kernel backend)

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden]; kv_layer: this layer's pool view [blocks, 1, block_size, 1, latent_dim]."""
        cfg = self.cfg
        projected = F.linear(x, self.input_proj)
        q, kv_a = projected[:, : self.q_rows], projected[:, self.q_rows :]  # column slices: views
        if self.q_b_proj is not None:
            assert self.q_a_layernorm is not None
            q_a = self.q_a_layernorm.add_and_norm(q, None) if self.fused else self.q_a_layernorm(q)
            q = F.linear(q_a, self.q_b_proj)
        q = q.view(-1, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)  # views of q
        latent_cache = kv_layer[:, 0]  # [blocks, block_size, 1, latent_dim]
        if self.fused:  # q_pe rotated in place (in q); the latent stored, and returned as the pool holds it
            latent = latent_store.latent_rope_norm_store(
                q,
                kv_a,
                batch.positions,
                self.rotary.cos_cache,
                self.rotary.sin_cache,
                self.kv_a_layernorm.weight,
                self.kv_a_layernorm.eps,
                batch.slot_blocks,
                batch.slot_offsets,
                latent_cache,
                self.rotary.interleaved,
            )
        else:
            c, k_pe = kv_a.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            q_pe = self.rotary(batch.positions, q_pe)
            k_pe = self.rotary(batch.positions, k_pe.unsqueeze(1)).squeeze(1)
            latent = torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)  # [T, latent_dim]: what the pool keeps
            kv_quant.store(latent_cache, batch.slot_blocks, batch.slot_offsets, latent.unsqueeze(1))  # fp8: quantised
            latent = kv_quant.round_trip(latent, latent_cache)  # a chunk attends to its own latents as stored
        out = self.backend.attend_mla(q_nope, q_pe, latent, latent_cache, self.kv_b_proj, batch, self.scale)
        return F.linear(out.reshape(-1, cfg.num_heads * cfg.v_head_dim), self.o_proj)

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        targets = {
            f"{prefix}.kv_a_proj_with_mqa.weight": self.input_proj[self.q_rows :],
            f"{prefix}.kv_a_layernorm.weight": self.kv_a_layernorm.weight,
            f"{prefix}.kv_b_proj.weight": self.kv_b_proj,
            f"{prefix}.o_proj.weight": self.o_proj,
        }
        if self.q_b_proj is None:
            targets[f"{prefix}.q_proj.weight"] = self.input_proj[: self.q_rows]
        else:
            assert self.q_a_layernorm is not None
            targets[f"{prefix}.q_a_proj.weight"] = self.input_proj[: self.q_rows]
            targets[f"{prefix}.q_a_layernorm.weight"] = self.q_a_layernorm.weight
            targets[f"{prefix}.q_b_proj.weight"] = self.q_b_proj
        return targets
