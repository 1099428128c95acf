"""What a model costs per token, from its HF config.json alone (pure Python: vLLM's side of the benchmark imports
it too): the parameters a token's matmuls use, the FLOPs of one query attending one key, the KV bytes a
token keeps, and the weight bytes a decode step reads. For the Llama family and for DeepSeek-V2/V3 (MLA +
MoE), whose numbers differ in kind:

- MoE: a token uses the dense layers, the shared experts and its top-k routed experts, not all experts, so
  MFU counts active parameters; a decode step of B rows reads every expert some row picked (under uniform
  routing, n x (1 - (1 - k/n)^B) of n per layer), not only k.
- MLA: a token keeps its compressed latent (kv_lora_rank) and its rotary key (qk_rope_head_dim) once per
  layer, not per head; prefill attends with per-head keys of qk_nope + qk_rope dims and values of v_head_dim
  (the decompressed form).

The MFU convention is ../shared/design/performance.md's: 2 FLOP per matmul parameter per token (embedding and
LM head excluded) plus attention FLOPs over the causal pairs.
"""

from __future__ import annotations

from typing import Any

from contracts.model_types import DEEPSEEK, architecture_of


def is_mla(config: dict[str, Any]) -> bool:
    return architecture_of(str(config.get("model_type", ""))) == DEEPSEEK


def _mla_attention_params(config: dict[str, Any]) -> int:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    v_dim, latent = int(config["v_head_dim"]), int(config["kv_lora_rank"])
    q_rank = config.get("q_lora_rank")
    q = hidden * heads * (nope + rope) if not q_rank else hidden * int(q_rank) + int(q_rank) * heads * (nope + rope)
    kv = hidden * (latent + rope) + latent * heads * (nope + v_dim)
    return q + kv + heads * v_dim * hidden


def _gqa_attention_params(config: dict[str, Any]) -> int:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    q_size = heads * head_dim
    kv_size = int(config.get("num_key_value_heads") or heads) * head_dim
    return hidden * (q_size + 2 * kv_size) + q_size * hidden


def _moe_layers(config: dict[str, Any]) -> int:
    """DeepSeek: layers from first_k_dense_replace on, every moe_layer_freq-th, are MoE; 0 for dense models."""
    if not is_mla(config) or not config.get("n_routed_experts"):
        return 0
    layers = int(config["num_hidden_layers"])
    first, every = int(config.get("first_k_dense_replace", 0)), int(config.get("moe_layer_freq", 1))
    return sum(1 for i in range(first, layers) if i % every == 0)


def _expert_params(config: dict[str, Any]) -> int:
    return 3 * int(config["hidden_size"]) * int(config["moe_intermediate_size"])


def _layer_params(config: dict[str, Any], routed_experts: float) -> float:
    """Every layer's parameters with `routed_experts` routed experts counted per MoE layer."""
    layers = int(config["num_hidden_layers"])
    attention = _mla_attention_params(config) if is_mla(config) else _gqa_attention_params(config)
    moe = _moe_layers(config)
    dense_mlp = 3 * int(config["hidden_size"]) * int(config["intermediate_size"])
    total = layers * attention + (layers - moe) * dense_mlp
    if moe:
        shared = int(config.get("n_shared_experts") or 0)
        router = int(config["hidden_size"]) * int(config["n_routed_experts"])
        total += moe * ((shared + routed_experts) * _expert_params(config) + router)
    return total


def matmul_params(config: dict[str, Any]) -> int:
    """Parameters one token's matmuls use (its top-k experts of the routed ones), embedding and LM head excluded."""
    return int(_layer_params(config, float(config.get("num_experts_per_tok") or 0)))


def total_params(config: dict[str, Any]) -> int:
    """Every weight: all experts, the embedding and the LM head."""
    embeddings = int(config["vocab_size"]) * int(config["hidden_size"])
    lm_head = 0 if config.get("tie_word_embeddings") else embeddings
    return int(_layer_params(config, float(config.get("n_routed_experts") or 0))) + embeddings + lm_head


def decode_weight_params(config: dict[str, Any], rows: int) -> int:
    """Weights a decode step of `rows` rows reads: all but the routed experts, the LM head, and the routed
    experts the rows pick (expected distinct under uniform top-k routing)."""
    lm_head = int(config["vocab_size"]) * int(config["hidden_size"])
    experts = int(config.get("n_routed_experts") or 0)
    k = int(config.get("num_experts_per_tok") or 0)
    picked = experts * (1 - (1 - k / experts) ** rows) if experts and k else 0.0
    return int(_layer_params(config, picked)) + lm_head


def attention_flops_per_pair(config: dict[str, Any]) -> int:
    """FLOPs of one query token attending one key token, summed over layers (QK^T and PV, 2 FLOP a MAC)."""
    layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    if is_mla(config):
        qk = int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])
        return layers * 2 * heads * (qk + int(config["v_head_dim"]))
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return layers * 4 * heads * head_dim


def prefill_flops(config: dict[str, Any], new: int, cached: int = 0) -> float:
    """A chunk of `new` tokens over `cached` ones: matmuls plus causal attention over prefix and chunk."""
    return 2 * matmul_params(config) * new + attention_flops_per_pair(config) * new * (cached + new / 2)


def kv_values_per_token(config: dict[str, Any]) -> int:
    """Values the KV cache keeps per token, all layers: MLA's latent + rotary key, else K and V per kv head."""
    layers = int(config["num_hidden_layers"])
    if is_mla(config):
        return layers * (int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"]))
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return layers * 2 * int(config.get("num_key_value_heads") or heads) * head_dim


def kv_bytes_per_token(config: dict[str, Any], element_bytes: float = 2) -> float:
    return kv_values_per_token(config) * element_bytes


def sessions_fitting(
    config: dict[str, Any], kv_pool_bytes: float, session_tokens: int, element_bytes: float = 2
) -> int:
    """Whole sessions of `session_tokens` whose KV fits in a pool of kv_pool_bytes."""
    return int(kv_pool_bytes // (kv_bytes_per_token(config, element_bytes) * session_tokens))
