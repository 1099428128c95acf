"""DeepSeek-V2/V3 (MLA attention over a compressed latent KV, MoE feed-forward) over a paged latent pool: the
same interface the engine uses for the Llama family (forward over a ForwardBatch, set_attention_backend,
choose_attention, kv_block_shape, load_hf_weights, init_random_weights).

The pool keeps per token per layer only the latent, kv_lora_rank + qk_rope_head_dim values (576 in the
V2-Lite/V3 shape, against 2 * heads * head_dim for a GQA model), block-major as the Llama pool, so a block
is still one contiguous chunk for the L1 copies.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from rank_worker.expert_parallel.shard import WHOLE, ExpertShard
from rank_worker.model import fused_ops, latent_store, residual_stream
from rank_worker.model.attention import decode_kernel, mla_decode_kernel
from rank_worker.model.attention.backend import AttentionBackend, BackendName
from rank_worker.model.attention.mla_sdpa import MlaSdpaAttention
from rank_worker.model.attention.mla_triton import MlaTritonAttention
from rank_worker.model.deepseek_config import DeepseekConfig
from rank_worker.model.forward_batch import ForwardBatch
from rank_worker.model.llama import RMSNorm, init_random_weights
from rank_worker.model.mla import LatentAttention
from rank_worker.model.moe import GatedMLP, MoE, Rearranged, empty_param
from rank_worker.model.yarn_rope import DeepseekRotary

log = logging.getLogger(__name__)

_EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, index: int, rotary: DeepseekRotary, shard: ExpertShard = WHOLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MoE | GatedMLP = (
            MoE(cfg, shard) if cfg.is_moe_layer(index) else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_layer, batch)
        return x + residual_stream.mlp_by_rows(self.mlp, self.post_attention_layernorm(x), batch.dense_rows)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: DeepseekConfig, max_positions: int, shard: ExpertShard = WHOLE) -> None:
        """shard: the routed experts this rank holds in an expert-parallel group (WHOLE: all of them)."""
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.rotary = DeepseekRotary(
            cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_interleave, max_positions
        )
        self.embed_tokens = empty_param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, self.rotary, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else empty_param(cfg.vocab_size, cfg.hidden_size)
        self.backend: AttentionBackend = MlaSdpaAttention()
        self.fused = False

    # --- what the engine asks of a model ---

    def kv_block_shape(self, block_size: int) -> tuple[int, ...]:
        """One pool block: [num_layers, 1, block_size, 1, kv_lora_rank + rope_dim] (the latent, one 'head')."""
        return (self.cfg.num_layers, 1, block_size, 1, self.cfg.latent_dim)

    def choose_attention(
        self, setting: BackendName, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> AttentionBackend:
        """MLA takes its own paths: auto and triton the MLA decode kernel (mla_triton.py) wherever it runs (CUDA,
        Triton, a power-of-two kv_lora_rank >= 16), with prefill through flash-attn 4 where it runs (an SM90 GPU,
        16-bit) and SDPA elsewhere; sdpa and auto elsewhere PyTorch alone (mla_sdpa.py). fa4 and flashinfer by
        name are refused: their paged kernels read per-head K/V, not latents."""
        fits = device.type == "cuda" and decode_kernel.available() and mla_decode_kernel.fits(self.cfg.kv_lora_rank)
        if setting in ("fa4", "flashinfer"):
            raise RuntimeError(
                f"attention_backend: {setting} has no MLA kernel here; DeepSeek models run attention_backend auto, "
                "triton or sdpa"
            )
        if setting == "triton" and not fits:
            raise RuntimeError("attention_backend: triton for MLA needs CUDA, Triton and a power-of-two kv_lora_rank")
        if setting in ("auto", "triton") and fits:
            from rank_worker.model.attention import fa4_backend

            cfg = self.cfg
            fa4 = (cfg.num_heads, cfg.qk_head_dim, cfg.v_head_dim, dtype) if fa4_backend.usable(device, dtype) else None
            if fa4 is None:
                # said at start: SDPA's prefill over a long prefix is slow enough to stall every decoder (a 1024-token
                # chunk over 100-400K tokens took 2-40 s on an H100, 2026-12-06), and nothing else shows it
                log.warning(
                    "MLA prefill runs SDPA, not flash-attn 4 (it needs an SM90 GPU, 16-bit weights and the cuda "
                    "extra's flash-attn-4): long prompts prefill far slower"
                )
            return MlaTritonAttention(fa4)
        return MlaSdpaAttention()

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        if not isinstance(backend, MlaSdpaAttention):
            raise TypeError(f"a DeepSeek model attends through MLA, not the {backend.name} backend")
        self.backend = backend
        # The kernel backend on CUDA takes the fused kernels too: norms with the residual add, the latent's
        # norm/rotary/store, SiLU x up; the SDPA backend stays the eager reference.
        self.fused = backend.fused_store and fused_ops.kernels_available(self.embed_tokens.device)
        for layer in self.layers:
            layer.self_attn.backend = backend
            layer.self_attn.fused = self.fused and latent_store.fits(self.cfg.qk_rope_head_dim)
            # a leading dense layer's MLP (MoE layers run their shared experts as experts: moe.py)
            if isinstance(layer.mlp, GatedMLP):
                layer.mlp.fused = self.fused

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_cache: [num_blocks, num_layers, 1, block_size, 1, latent_dim]. Returns float32 logits [S, vocab]."""
        self.backend.plan(batch)
        x = F.embedding(batch.input_ids, self.embed_tokens)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if self.fused:
            return F.linear(residual_stream.run_fused(self.layers, x, kv_cache, batch, self.norm), head).float()
        for index, layer in enumerate(self.layers):
            x = layer(x, kv_cache[:, index], batch)
        return F.linear(self.norm(x[batch.logits_indices]), head).float()

    # --- weights ---

    def hf_targets(self) -> dict[str, torch.Tensor | Rearranged]:
        """Every Hugging Face tensor name this model reads -> the parameter (or part of one) it fills, or how it
        is rearranged into one (the shared experts' MLP, cut into experts)."""
        targets: dict[str, torch.Tensor | Rearranged] = {
            "model.embed_tokens.weight": self.embed_tokens,
            "model.norm.weight": self.norm.weight,
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}"
            targets[f"{prefix}.input_layernorm.weight"] = layer.input_layernorm.weight
            targets[f"{prefix}.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
            targets.update(layer.self_attn.hf_targets(f"{prefix}.self_attn"))
            targets.update(layer.mlp.hf_targets(f"{prefix}.mlp"))
        return targets

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in; every parameter must be covered. V3's multi-token-prediction
        layers (model.layers.{num_layers}...) are not part of the forward and are skipped, as are the routed
        experts other ranks of an expert-parallel group hold (a loader given skipped_by_shard never reads them)."""
        targets = self.hf_targets()
        filled: set[str] = set()
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                if name.endswith("rotary_emb.inv_freq") or self._is_mtp(name) or self.skipped_by_shard(name):
                    continue
                if name == "lm_head.weight":
                    continue  # tied checkpoints sometimes carry a copy
                raise ValueError(f"unexpected tensor {name} for this {self.cfg.model_type} model")
            if tuple(target.shape) != tuple(tensor.shape):  # a Rearranged's shape is the checkpoint's
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
            if isinstance(target, Rearranged):
                tensor, target = target.arrange(tensor), target.into
            with torch.no_grad():
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            filled.add(name)
        missing = [name for name in targets if name not in filled]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def skipped_by_shard(self, name: str) -> bool:
        """Whether the Hugging Face tensor `name` is a routed expert of a MoE layer that another rank of this
        model's expert-parallel group holds: the loaders leave such tensors on disk (source.SkipTensor)."""
        match = _EXPERT_TENSOR.match(name)
        if match is None or self.shard.whole:
            return False
        layer, expert = int(match[1]), int(match[2])
        if layer >= self.cfg.num_layers:
            return False  # an MTP layer's: _is_mtp's
        mlp = self.layers[layer].mlp
        # an id past n_routed_experts or an expert of a dense layer is not skipped: the load refuses it by name
        return isinstance(mlp, MoE) and expert < self.cfg.n_routed_experts and expert not in mlp.routed

    def _is_mtp(self, name: str) -> bool:
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return False
        index = int(parts[2])
        return self.cfg.num_layers <= index < self.cfg.num_layers + self.cfg.num_mtp_layers

    def init_random_weights(self, seed: int = 0, scheme: str = "normal") -> None:
        """Random weights for benchmarks (llama.RANDOM_INIT_SCHEMES): by default normal(0, 0.02), norms 1, biases
        (the router's correction bias) 0; a shard's experts are the whole model's rows for their ids."""
        init_random_weights(self, seed, scheme)
