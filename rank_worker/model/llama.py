"""The Llama family (Llama 3.x, Mistral, Qwen2/2.5 with q/k/v bias, Qwen3 with q/k norm, SmolLM2, SmolLM3 with
NoPE layers) over a paged KV pool; config features it does not implement are refused by feature_check.py.

Parameters are created empty on the target device (no init pass) and then either loaded from Hugging
Face-named tensors or filled with random values. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from rank_worker.expert_parallel.shard import WHOLE, ExpertShard
from rank_worker.model import fused_ops, residual_stream
from rank_worker.model.attention.backend import AttentionBackend, BackendName
from rank_worker.model.attention.sdpa_backend import SdpaAttention, write_kv
from rank_worker.model.attention.selector import choose_backend
from rank_worker.model.config import LlamaFamilyConfig
from rank_worker.model.forward_batch import ForwardBatch
from rank_worker.model.rotary import RotaryEmbedding

# Part of the KV-cache namespace of random weights: change one whenever init_random_weights draws differently.
RANDOM_INIT_SCHEMES = {
    "normal": "normal(0, 0.02), each parameter from a generator seeded by (seed, its name), each row of an expert "
    "stack by (seed, name, global expert id) or (seed, name, 'shared', s); norms 1, biases 0 (draw 2)",
    # vLLM's load_format dummy: every parameter, norms too, each from a generator seeded alike, so tensors of
    # one size and dtype are equal (every layer's; the LM head is the embedding). Side by side with vLLM on
    # random weights, a MoE's routing (how many experts a decode step reads) depends on the draw. An expert
    # stack's rows are seeded by expert instead (alike in every layer too), so a shard draws its own experts.
    "uniform": "uniform(-1e-3, 1e-3), every parameter from its own generator seeded alike, each row of an expert "
    "stack by (seed, global expert id) or (seed, 'shared', s) (draw 2)",
}


def init_random_weights(model: nn.Module, seed: int = 0, scheme: str = "normal") -> None:
    """RANDOM_INIT_SCHEMES[scheme] over any model of ours (the Llama and DeepSeek families share them, so a
    digest of the seed, scheme and shape names the same weights wherever they are made). A parameter's values
    depend on its name alone, never on which others exist, and an expert's rows on its global id: a rank holding
    a shard of the experts (expert_parallel/) draws what the whole model has in those rows."""
    if scheme not in RANDOM_INIT_SCHEMES:
        raise ValueError(f"random weights: no scheme {scheme!r} (one of {sorted(RANDOM_INIT_SCHEMES)})")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    stacks = _expert_stack_rows(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if scheme == "normal" and name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if scheme == "normal" and name.endswith("bias"):
                param.zero_()
                continue
            stream = (name,) if scheme == "normal" else ()  # uniform: seeded alike, whatever the name
            rows = stacks.get(name)
            if rows is None:
                seeded = generator.manual_seed(_stream_seed(seed, *stream) if stream else seed)
                _draw(param, scheme, seeded)
                continue
            for row, key in enumerate(rows):  # one launch an expert: the stack's rows are views
                _draw(param[row], scheme, generator.manual_seed(_stream_seed(seed, *stream, *key)))


def _expert_stack_rows(model: nn.Module) -> dict[str, list[tuple[str | int, ...]]]:
    """Each expert stack's name -> what its rows are: a MoE's own parameters (moe.py's experts_gate_up and
    experts_down: the routed experts it holds, by global id, then the shared ones)."""
    stacks: dict[str, list[tuple[str | int, ...]]] = {}
    for prefix, module in model.named_modules():
        routed = getattr(module, "routed", None)
        if not isinstance(routed, range):
            continue
        keys: list[tuple[str | int, ...]] = [(e,) for e in routed]
        keys += [("shared", s) for s in range(module.shared)]
        for name, param in module.named_parameters(recurse=False):
            if param.shape[0] != len(keys):
                raise ValueError(f"{prefix}.{name}: {param.shape[0]} rows for {len(keys)} experts")
            stacks[f"{prefix}.{name}" if prefix else name] = keys
    return stacks


def _stream_seed(seed: int, *parts: str | int) -> int:
    """A generator seed from (seed, parts), stable across processes and machines (Python's hash() is not)."""
    text = "\x1f".join(str(part) for part in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _draw(values: torch.Tensor, scheme: str, generator: torch.Generator) -> None:
    if scheme == "uniform":
        values.uniform_(-1e-3, 1e-3, generator=generator)
    else:
        values.normal_(0.0, 0.02, generator=generator)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.rms_norm_reference(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The fused kernel: residual += x in place (when given), then this norm of the sum."""
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = _param(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
        self.qkv_bias = _param(cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else None
        self.o_proj = _param(cfg.hidden_size, cfg.q_size)
        self.o_bias = _param(cfg.hidden_size) if cfg.output_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5
        self.backend: AttentionBackend = SdpaAttention()
        self.fused_rope = False  # rotary + K/V store by one kernel (CUDA; not with q/k norms)

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        k_cache, v_cache = kv_layer[:, 0], kv_layer[:, 1]
        if self.fused_rope:
            rotary = self.rotary
            fused_ops.rope_and_store(
                qkv,
                batch.positions,
                None if rotary is None else rotary.cos_cache,
                None if rotary is None else rotary.sin_cache,
                batch.slot_blocks,
                batch.slot_offsets,
                k_cache,
                v_cache,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
            )
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if not self.fused_rope:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotary is not None:  # None in a NoPE layer (SmolLM3): positions come from the causal mask alone
                q, k = self.rotary(batch.positions, q, k)
            write_kv(k_cache, v_cache, k, v, batch)
        out = self.backend.attend(q, k, v, k_cache, v_cache, batch, self.scale)
        return F.linear(out.reshape(-1, cfg.q_size), self.o_proj, self.o_bias)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig) -> None:
        super().__init__()
        self.gate_up_proj = _param(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size)
        self.fused = False  # SiLU x up by one kernel (CUDA)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_proj)
        act = fused_ops.silu_and_mul(gate_up) if self.fused else fused_ops.silu_and_mul_reference(gate_up)
        return F.linear(act, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_layer, batch)
        return x + residual_stream.mlp_by_rows(self.mlp, self.post_attention_layernorm(x), batch.dense_rows)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, max_positions: int, shard: ExpertShard = WHOLE) -> None:
        """shard: always WHOLE (a dense MLP has no routed experts to split); taken as every family's model takes it
        (registry.py)."""
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary if cfg.uses_rope(index) else None) for index in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.backend: AttentionBackend = SdpaAttention()
        self.fused = False

    def kv_block_shape(self, block_size: int) -> tuple[int, ...]:
        """One pool block: [num_layers, 2 (K, V), block_size, kv_heads, head_dim]."""
        cfg = self.cfg
        return (cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)

    def choose_attention(
        self, setting: BackendName, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> AttentionBackend:
        cfg = self.cfg
        group = cfg.num_heads // cfg.num_kv_heads
        return choose_backend(setting, device, dtype, cfg.num_heads, cfg.head_dim, group, kv_dtype)

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Attention by `backend`; with a CUDA backend the elementwise work runs as fused kernels too."""
        self.backend = backend
        self.fused = backend.fused_store and fused_ops.kernels_available(self.embed_tokens.device)
        for layer in self.layers:
            attn = layer.self_attn
            attn.backend = backend
            attn.fused_rope = self.fused and attn.q_norm is None and fused_ops.rope_store_fits(self.cfg.head_dim)
            layer.mlp.fused = self.fused

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_cache: [num_blocks, num_layers, 2, block_size, Hkv, D]. Returns float32 logits [S, vocab]."""
        self.backend.plan(batch)
        x = F.embedding(batch.input_ids, self.embed_tokens)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if not self.fused:
            for index, layer in enumerate(self.layers):
                x = layer(x, kv_cache[:, index], batch)
            return F.linear(self.norm(x[batch.logits_indices]), head).float()
        return F.linear(residual_stream.run_fused(self.layers, x, kv_cache, batch, self.norm), head).float()

    # --- weights ---

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (fusing q/k/v and gate/up); every parameter must be covered."""
        cfg = self.cfg
        filled: set[str] = set()
        qkv_rows = {"q_proj": (0, cfg.q_size), "k_proj": (cfg.q_size, cfg.kv_size)}
        qkv_rows["v_proj"] = (cfg.q_size + cfg.kv_size, cfg.kv_size)
        mlp_rows = {"gate_proj": (0, cfg.intermediate_size), "up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
        for name, tensor in weights:
            parts = name.split(".")
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints store the rotary table; ours is computed
            if name == "model.embed_tokens.weight":
                target, key = self.embed_tokens, "embed_tokens"
            elif name == "model.norm.weight":
                target, key = self.norm.weight, "norm"
            elif name == "lm_head.weight":
                if self.lm_head is None:
                    continue  # tied checkpoints sometimes carry a copy
                target, key = self.lm_head, "lm_head"
            elif parts[:2] == ["model", "layers"]:
                layer = self.layers[int(parts[2])]
                module, proj, kind = parts[3], parts[4], parts[-1]
                key = "layers." + ".".join(parts[2:])
                if module == "self_attn" and proj in qkv_rows:
                    start, rows = qkv_rows[proj]
                    fused = layer.self_attn.qkv_proj if kind == "weight" else layer.self_attn.qkv_bias
                    if fused is None:
                        raise ValueError(f"unexpected tensor {name}: this model has no attention bias")
                    target = fused[start : start + rows]
                elif module == "mlp" and proj in mlp_rows:
                    start, rows = mlp_rows[proj]
                    target = layer.mlp.gate_up_proj[start : start + rows]
                else:
                    target = _named_layer_param(layer, module, proj, kind, name)
            else:
                continue  # e.g. rotary inv_freq buffers in old checkpoints
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            filled.add(key)
        missing = [k for k in self._expected_keys() if k not in filled]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def _expected_keys(self) -> list[str]:
        cfg = self.cfg
        keys = ["embed_tokens", "norm"] + ([] if self.lm_head is None else ["lm_head"])
        per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
        per_layer += ["self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"]
        per_layer += ["mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
        if cfg.attention_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if cfg.output_bias:
            per_layer += ["self_attn.o_proj.bias"]
        if cfg.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        return keys + [f"layers.{i}.{p}" for i in range(cfg.num_layers) for p in per_layer]

    def init_random_weights(self, seed: int = 0, scheme: str = "normal") -> None:
        """Random weights for benchmarks: the real shapes, FLOPs and bytes, nonsense text."""
        init_random_weights(self, seed, scheme)


def _named_layer_param(layer: DecoderLayer, module: str, proj: str, kind: str, name: str) -> torch.Tensor:
    if module == "self_attn" and proj == "o_proj":
        if kind != "bias":
            return layer.self_attn.o_proj
        if layer.self_attn.o_bias is None:
            raise ValueError(f"unexpected tensor {name}: this model has no o_proj bias")
        return layer.self_attn.o_bias
    if module == "self_attn" and proj in ("q_norm", "k_norm"):
        norm = getattr(layer.self_attn, proj)
        if norm is None:
            raise ValueError(f"unexpected tensor {name}: this model has no q/k norm")
        return norm.weight
    if module == "mlp" and proj == "down_proj":
        return layer.mlp.down_proj
    if module in ("input_layernorm", "post_attention_layernorm"):
        return getattr(layer, module).weight
    raise ValueError(f"unexpected tensor {name}")
