"""DeepSeek-V2/V3 in a GGUF: llama.cpp's "deepseek2" architecture (DeepSeek-V2, V2-Lite, V2.5, V3, R1 and models
built on them), turned into the HF config deepseek_config.py reads and HF-named float32 weights.

The layout is the one llama.cpp's converter writes (conversion/deepseek.py, DeepseekV2Model) and its loader
reads (src/models/deepseek2.cpp):
- a MoE layer's routed experts are stacked into 3-D ffn_{gate,up,down}_exps tensors ([experts, rows, cols] in
  HF order), the router is ffn_gate_inp, V3's e_score_correction_bias is exp_probs_b.bias, the shared experts
  are ffn_{gate,up,down}_shexp;
- newer files split kv_b_proj per head into attn_k_b (the K rows, transposed: [heads, kv_lora_rank,
  qk_nope_head_dim]) and attn_v_b ([heads, v_head_dim, kv_lora_rank]) and give the head sizes in
  attention.key_length_mla / value_length_mla; older files keep attn_kv_b, sized by key_length / value_length;
- nothing is permuted: llama.cpp rotates deepseek2 as adjacent pairs, DeepSeek's own interleaved layout;
- rope.scaling.yarn_log_multiplier holds 0.1 * mscale_all_dim, and llama.cpp takes mscale equal to it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rank_worker.model_files.gguf_dequant import dequantized
from rank_worker.model_files.gguf_rope import rope_scaling_from_metadata
from rank_worker.model_files.source import ModelPathError, SkipTensor

DEEPSEEK2 = ARCH = "deepseek2"

# llama.cpp's expert_gating_func -> the model type whose router scores that way. 0 (absent) is softmax, as
# llama.cpp reads V2 files written before the key existed.
_MODEL_TYPE_BY_GATING = {0: "deepseek_v2", 1: "deepseek_v2", 2: "deepseek_v3"}
_ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
# Stacked routed experts -> the projection each expert's slice is in HF.
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
_SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight")
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+\.(?:weight|bias))")


@dataclass(frozen=True)
class PlannedWeight:
    """HF weights made from GGUF tensors: one for one, one per expert of a stacked tensor, or kv_b_proj
    rebuilt from attn_k_b and attn_v_b."""

    kind: str  # "plain" | "experts" | "kv_b"
    sources: tuple[str, ...]
    hf_names: tuple[str, ...]


def deepseek2_hf_config(path: Path, metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the DeepSeek model a deepseek2 GGUF was converted from, as far as the engine reads it."""

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{ARCH}.{key}")
        return default if value is None else value

    def need(key: str) -> Any:
        value = metadata.get(f"{ARCH}.{key}")
        if value is None:
            raise ModelPathError(f"GGUF {path} lacks metadata {ARCH}.{key}")
        return value

    if "token_embd.weight" not in tensors:
        raise ModelPathError(f"GGUF {path} has no token_embd.weight tensor")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    rope_dim = int(need("rope.dimension_count"))
    if get("attention.key_length_mla") and get("attention.value_length_mla"):
        qk_head_dim, v_head_dim = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
    elif any(name.endswith(_SPLIT_KV_B) for name in tensors):
        # In a split file key_length/value_length describe llama.cpp's absorbed form, not the heads.
        raise ModelPathError(
            f"GGUF {path} has split attn_k_b/attn_v_b tensors but no {ARCH}.attention.key_length_mla / "
            "value_length_mla to size the heads"
        )
    else:
        qk_head_dim = int(get("attention.key_length") or hidden // heads)
        v_head_dim = int(get("attention.value_length") or qk_head_dim)
    if qk_head_dim <= rope_dim:
        raise ModelPathError(f"GGUF {path}: key length {qk_head_dim} leaves no dims beside the {rope_dim} rotary ones")

    gating = int(get("expert_gating_func", 0))
    if gating not in _MODEL_TYPE_BY_GATING:
        raise ModelPathError(
            f"GGUF {path} has {ARCH}.expert_gating_func {gating}, which is not supported "
            "(1: softmax, DeepSeek-V2; 2: sigmoid, DeepSeek-V3)"
        )
    model_type = _MODEL_TYPE_BY_GATING[gating]
    groups = int(get("expert_group_count", 0) or 1)
    groups_used = int(get("expert_group_used_count", 0) or groups)
    # DeepSeek-V2 ranks groups by their best expert (transformers, DeepSeek's code); llama.cpp ranks every grouped
    # model by its two best, as V3 does. We follow the model the file was converted from.
    v2_method = "group_limited_greedy" if groups > 1 else "greedy"
    topk_method = "noaux_tc" if model_type == "deepseek_v3" else v2_method

    rope_theta = float(get("rope.freq_base", 10_000.0))
    rope_scaling = rope_scaling_from_metadata(path, ARCH, metadata, None, rope_theta)
    if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
        rope_scaling |= _yarn_parameters(path, metadata)
    return {
        "model_type": model_type,
        "architectures": [_ARCHITECTURES[model_type]],
        # The embedding matrix is the ground truth: some files pad it past the tokenizer's vocabulary.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "q_lora_rank": int(get("attention.q_lora_rank", 0)) or None,  # absent or 0: V2-Lite's uncompressed q
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "n_routed_experts": int(get("expert_count", 0)),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "num_experts_per_tok": int(get("expert_used_count", 0)),
        "moe_intermediate_size": int(get("expert_feed_forward_length", 0)),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "moe_layer_freq": 1,  # llama.cpp makes every layer after the leading dense ones MoE
        "n_group": groups,
        "topk_group": groups_used,
        "topk_method": topk_method,
        "scoring_func": "sigmoid" if model_type == "deepseek_v3" else "softmax",
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "routed_scaling_factor": float(get("expert_weights_scale", 0.0) or 1.0),  # absent: llama.cpp does not scale
        "torch_dtype": "float32",
    }


def _yarn_parameters(path: Path, metadata: dict[str, Any]) -> dict[str, Any]:
    """The YaRN keys beyond factor/original context that DeepSeek's config carries, as llama.cpp runs them."""
    for key in ("yarn_ext_factor", "yarn_attn_factor"):
        if metadata.get(f"{ARCH}.rope.scaling.{key}") is not None:
            raise ModelPathError(f"GGUF {path} sets {ARCH}.rope.scaling.{key}, which is not supported")
    beta_fast = metadata.get(f"{ARCH}.rope.scaling.yarn_beta_fast")
    beta_slow = metadata.get(f"{ARCH}.rope.scaling.yarn_beta_slow")
    parameters: dict[str, Any] = {
        "beta_fast": 32.0 if beta_fast is None else float(beta_fast),  # llama.cpp's defaults, DeepSeek's values
        "beta_slow": 1.0 if beta_slow is None else float(beta_slow),
    }
    log_multiplier = metadata.get(f"{ARCH}.rope.scaling.yarn_log_multiplier")
    if log_multiplier:
        # The converter writes 0.1 * mscale_all_dim; llama.cpp divides the 0.1 out and uses mscale = mscale_all_dim
        # (so cos/sin stay unscaled and only the softmax scale is corrected, as in every DeepSeek config).
        mscale = float(log_multiplier) / 0.1
        parameters |= {"mscale": mscale, "mscale_all_dim": mscale}
    return parameters


def plan_deepseek2_weights(path: Path, hf_config: dict[str, Any], tensors: dict[str, Any]) -> list[PlannedWeight]:
    """Where every HF weight of the model comes from. A GGUF tensor the model has no place for, or a weight the
    model needs that the file lacks, fails here rather than surfacing deep inside the engine."""
    expected = _expected_tensors(hf_config, tensors)
    expected_set = set(expected)
    unknown = [name for name in tensors if name not in expected_set]
    if unknown:
        shown = ", ".join(unknown[:8]) + (", ..." if len(unknown) > 8 else "")
        raise ModelPathError(f"GGUF {path} has {len(unknown)} tensors with no {ARCH} equivalent: {shown}")
    missing = [name for name in expected if name not in tensors]
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ModelPathError(f"GGUF {path} lacks {len(missing)} tensors: {shown}")

    experts = hf_config["n_routed_experts"]
    plan: list[PlannedWeight] = []
    for name in expected:
        if name in _TOP_LEVEL_NAMES:
            plan.append(PlannedWeight("plain", (name,), (_TOP_LEVEL_NAMES[name],)))
            continue
        match = _BLOCK_TENSOR.fullmatch(name)
        assert match is not None  # _expected_tensors only names top-level and block tensors
        layer, leaf = match[1], match[2]
        prefix = f"model.layers.{layer}"
        if leaf in _EXPERT_NAMES:
            shape = _ne(tensors[name])
            if len(shape) != 3 or shape[2] != experts:  # ne[2] counts the experts
                raise ModelPathError(
                    f"GGUF {path}: {name} has shape {shape} (ggml order), not a stack of "
                    f"{ARCH}.expert_count = {experts} experts"
                )
            hf_names = tuple(f"{prefix}.mlp.experts.{e}.{_EXPERT_NAMES[leaf]}.weight" for e in range(experts))
            plan.append(PlannedWeight("experts", (name,), hf_names))
        elif leaf == _SPLIT_KV_B[0]:
            sources = (name, f"blk.{layer}.{_SPLIT_KV_B[1]}")
            _check_split_kv_b(path, hf_config, *(tensors[source] for source in sources))
            plan.append(PlannedWeight("kv_b", sources, (f"{prefix}.self_attn.kv_b_proj.weight",)))
        elif leaf != _SPLIT_KV_B[1]:  # attn_v_b is read with attn_k_b
            plan.append(PlannedWeight("plain", (name,), (f"{prefix}.{_BLOCK_NAMES[leaf]}",)))
    return plan


def _check_split_kv_b(path: Path, hf_config: dict[str, Any], k_b: Any, v_b: Any) -> None:
    """The halves must rebuild kv_b_proj of the heads the metadata sizes; a mismatch would not show as one."""
    heads, rank = hf_config["num_attention_heads"], hf_config["kv_lora_rank"]
    want_k = (hf_config["qk_nope_head_dim"], rank, heads)  # ggml ne order, innermost first
    want_v = (rank, hf_config["v_head_dim"], heads)
    for tensor, want in ((k_b, want_k), (v_b, want_v)):
        if _ne(tensor) != want:
            raise ModelPathError(
                f"GGUF {path}: {tensor.name} has shape {_ne(tensor)} (ggml order), the metadata implies {want}"
            )


def _ne(tensor: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in tensor.shape)


def _expected_tensors(hf_config: dict[str, Any], tensors: dict[str, Any]) -> list[str]:
    """Every GGUF tensor this model reads, in file-independent order. kv_b comes in whichever form the layer has:
    attn_kv_b when present, else the split pair (so a layer with neither reports the split pair missing)."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not hf_config["tie_word_embeddings"]:
        names.append("output.weight")
    attention = ["attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", "ffn_norm"]
    attention += ["attn_q"] if hf_config["q_lora_rank"] is None else ["attn_q_a", "attn_q_a_norm", "attn_q_b"]
    moe = ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
    if hf_config["n_shared_experts"]:
        moe += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    for i in range(hf_config["num_hidden_layers"]):
        block = [f"{leaf}.weight" for leaf in attention]
        if f"blk.{i}.attn_kv_b.weight" in tensors:
            block.append("attn_kv_b.weight")
        else:
            block += list(_SPLIT_KV_B)
        if hf_config["n_routed_experts"] and i >= hf_config["first_k_dense_replace"]:
            block += [f"{leaf}.weight" for leaf in moe]
            if hf_config["scoring_func"] == "sigmoid":
                block.append("exp_probs_b.bias")
        else:
            block += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
        names += [f"blk.{i}.{leaf}" for leaf in block]
    return names


def iter_deepseek2_weights(
    plan: list[PlannedWeight], tensors: dict[str, Any], skip: SkipTensor | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every planned weight `skip` keeps; a stacked expert tensor is dequantized one
    expert at a time, so the peak is one expert's float32 copy, not the whole stack's. An expert is one contiguous
    block of the stack's quantized rows, sliced before dequantizing: the experts left out are never read."""
    for weight in plan:
        if skip is not None and all(skip(name) for name in weight.hf_names):
            continue
        if weight.kind == "experts":
            stacked = tensors[weight.sources[0]]
            for index, hf_name in enumerate(weight.hf_names):
                if skip is None or not skip(hf_name):
                    yield hf_name, dequantized(stacked, index)
        elif weight.kind == "kv_b":
            k_b, v_b = (dequantized(tensors[name]) for name in weight.sources)
            yield weight.hf_names[0], kv_b_from_split(k_b, v_b)
        else:
            yield weight.hf_names[0], dequantized(tensors[weight.sources[0]])


def kv_b_from_split(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] from llama.cpp's halves.

    The converter views kv_b_proj as [heads, nope + v, rank], splits each head's rows into K (nope) and V,
    and transposes K: k_b [heads, rank, nope], v_b [heads, v, rank] (HF order).
    """
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1]).contiguous()
