"""Tiny random DeepSeek-V2/V3 checkpoints written by transformers (the reference), and our engine's model
loaded from them: MLA with a 32-value latent, 8 routed experts in 2 groups, the first layer dense."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from engine_fixtures import embolden_weights, write_word_tokenizer

from rank_worker.engine.factory import build_model
from rank_worker.engine.interface import TokenizerBundle
from rank_worker.model.causal_lm import CausalLM
from rank_worker.model_files.opener import open_model_source

VOCAB = 96
# MLA (a 32-value latent) and MoE (8 routed experts in 2 groups, top-2, one shared), the first layer dense:
# the part test_model_parity's DeepSeek cases share with these checkpoints.
MLA_MOE_LAYERS = dict(
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
)
MLA_MOE = dict(
    MLA_MOE_LAYERS,
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=512,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
# V2 as DeepSeek-V2 (group-limited routing, yarn) but without q compression and with two shared experts, as
# V2-Lite (the shared MLP is cut into two experts: moe.py).
V2 = dict(
    MLA_MOE,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    topk_method="group_limited_greedy",
    rope_parameters=YARN,
    n_shared_experts=2,
)
V3 = dict(MLA_MOE, q_lora_rank=24, qk_rope_head_dim=16, routed_scaling_factor=2.5)
CLASSES = {
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, V2),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, V3),
}


def write_deepseek(model_type: str, directory: Path, seed: int = 1234, **overrides: Any) -> torch.nn.Module:
    """A random transformers model saved as a complete HF directory (safetensors, tokenizer); V3's routing
    correction bias drawn too, so it changes which experts are chosen."""
    config_cls, model_cls, base = CLASSES[model_type]
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**{**base, **overrides})).eval()
    embolden_weights(hf)
    with torch.no_grad():
        for layer in hf.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.3)
    hf.save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory, hf.config.vocab_size)
    return hf


def load_ours(directory: Path, dtype: torch.dtype = torch.float32) -> tuple[CausalLM, TokenizerBundle]:
    source = open_model_source(str(directory))
    assert source.tokenizer is not None
    return build_model(source, torch.device("cpu"), dtype, max_positions=512, seed=0), source.tokenizer


def reference_greedy(hf: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    """Plain argmax over full recomputation by transformers."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]
