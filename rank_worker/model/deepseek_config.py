"""The architecture facts of a DeepSeek-V2/V3 model (MLA attention, MoE feed-forward), read from a normalized
config.json (model_files/hf_config.py), and the refusal of the features our code does not implement.

Semantics follow transformers' modeling_deepseek_v2.py / modeling_deepseek_v3.py (and DeepSeek's own code
where transformers reads no key): V2 routes by softmax scores (greedy, or group_limited_greedy: the best
topk_group groups by their best expert), V3 by sigmoid scores plus e_score_correction_bias (noaux_tc: groups
ranked by the sum of their two best experts); V2 rotates the rope dims as interleaved pairs, V3 as pairs too
unless rope_interleave is false (then the half-split Llama layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rank_worker.model.feature_check import UnsupportedModelError

_ROPE_TYPES = ("default", "yarn")
# model_type -> (scoring function, top-k methods) that transformers' implementation of that type computes.
_ROUTING = {
    "deepseek_v2": ("softmax", ("greedy", "group_limited_greedy")),
    "deepseek_v3": ("sigmoid", ("noaux_tc",)),
}


@dataclass(frozen=True)
class DeepseekConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: q from one projection (V2-Lite); else q_a -> norm -> q_b
    kv_lora_rank: int  # the compressed latent every head's K/V is expanded from
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # rotary part of q/k; its K side is one shared head, stored beside the latent
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or yarn
    rope_interleave: bool  # rope dims paired as (0,1), (2,3)... (V2 always; V3 by default)
    max_position_embeddings: int
    tie_word_embeddings: bool
    # MoE
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    topk_method: str  # greedy | group_limited_greedy | noaux_tc
    scoring_func: str  # softmax | sigmoid
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_mtp_layers: int = 0  # V3's multi-token-prediction layers after the last one (skipped when loading)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the paged pool keeps per token per layer: the normalized latent, then the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, index: int) -> bool:
        return self.n_routed_experts > 0 and index >= self.first_k_dense_replace and index % self.moe_layer_freq == 0

    @property
    def num_params_excluding_embeddings(self) -> int:
        """Parameters a token's matmuls touch (the active ones: shared and top-k routed experts), for MFU."""
        h, heads = self.hidden_size, self.num_heads
        if self.q_lora_rank is None:
            q = h * heads * self.qk_head_dim
        else:
            q = h * self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
        kv = h * self.latent_dim + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        attn = q + kv + heads * self.v_head_dim * h
        dense = 3 * h * self.intermediate_size
        active_experts = self.num_experts_per_tok + self.n_shared_experts
        moe = 3 * h * self.moe_intermediate_size * active_experts + h * self.n_routed_experts
        return sum(attn + (moe if self.is_moe_layer(i) else dense) for i in range(self.num_layers))

    @classmethod
    def for_serving(cls, hf: dict[str, Any], max_positions: int) -> DeepseekConfig:
        """from_hf: none of what it refuses depends on the served length (no sliding window)."""
        return cls.from_hf(hf)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DeepseekConfig:
        """Parse a normalized config.json; raises UnsupportedModelError naming what our code cannot serve."""
        problems = unsupported_deepseek_features(hf)
        if problems:
            raise UnsupportedModelError(f"this {hf.get('model_type')} model cannot be served: " + "; ".join(problems))
        model_type = str(hf["model_type"])
        scoring, methods = _ROUTING[model_type]
        q_lora_rank = hf.get("q_lora_rank")
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=int(hf["num_attention_heads"]),
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)),
            v_head_dim=int(hf.get("v_head_dim", 128)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta") or 10000.0),
            rope_scaling=hf.get("rope_scaling"),
            rope_interleave=model_type == "deepseek_v2" or bool(hf.get("rope_interleave", True)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            n_routed_experts=int(hf.get("n_routed_experts") or 0),
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)),
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(hf.get("moe_layer_freq") or 1),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            topk_method=str(hf.get("topk_method") or methods[0]),
            scoring_func=str(hf.get("scoring_func") or scoring),
            norm_topk_prob=bool(hf.get("norm_topk_prob", model_type == "deepseek_v3")),
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
        )


def unsupported_deepseek_features(hf: dict[str, Any]) -> list[str]:
    """One message per feature of a DeepSeek config.json our code would get wrong; [] when fully supported."""
    model_type = str(hf.get("model_type"))
    problems: list[str] = []
    if model_type not in _ROUTING:
        return [f"model_type {model_type!r} is not a DeepSeek type ({', '.join(_ROUTING)})"]
    scoring, methods = _ROUTING[model_type]
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        problems.append(f"quantized checkpoints (quantization_config: {method}) are not supported; use bf16 weights")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        problems.append(f"hidden_act {hf.get('hidden_act')!r} is not implemented (only silu)")
    if hf.get("attention_bias"):
        problems.append("attention biases (attention_bias: true) are not implemented")
    if hf.get("mlp_bias"):
        problems.append("MLP biases (mlp_bias: true) are not implemented")
    scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        problems.append(f"rope scaling {rope_type!r} is not implemented for {model_type} (supported: default, yarn)")
    if rope_type == "yarn" and not {"factor", "original_max_position_embeddings"} <= set(scaling):
        problems.append("yarn rope scaling needs factor and original_max_position_embeddings")
    if scaling.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        problems.append("partial rotary embedding is not implemented")
    if hf.get("scoring_func", scoring) != scoring:
        problems.append(f"{model_type} routes with {scoring} scores, not scoring_func {hf.get('scoring_func')!r}")
    method = hf.get("topk_method") or methods[0]
    if method not in methods:
        problems.append(f"{model_type} routes by {' or '.join(methods)}, not topk_method {method!r}")
    if model_type == "deepseek_v2" and hf.get("norm_topk_prob") and int(hf.get("num_experts_per_tok") or 0) > 1:
        # DeepSeek-V2's own code then normalizes instead of scaling, transformers scales: no one reference.
        problems.append("norm_topk_prob: true is not implemented for deepseek_v2")
    experts = int(hf.get("n_routed_experts") or 0)
    groups = int(hf.get("n_group") or 1)
    if experts:
        top_k = int(hf.get("num_experts_per_tok") or 0)
        if experts % groups:
            problems.append(f"n_routed_experts {experts} is not a multiple of n_group {groups}")
        if not 0 < top_k <= experts:
            problems.append(f"num_experts_per_tok {top_k} must be in [1, n_routed_experts={experts}]")
        if method != "greedy" and not 0 < int(hf.get("topk_group") or 1) <= groups:
            problems.append(f"topk_group {hf.get('topk_group')} must be in [1, n_group={groups}]")
        if method == "noaux_tc" and experts // groups < 2:
            problems.append("noaux_tc routing ranks groups by their two best experts: n_group leaves fewer than 2")
    return problems
