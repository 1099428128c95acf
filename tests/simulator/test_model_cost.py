"""simulator/model_cost.py against what it summarises: parameter counts against transformers' own models of the same
config (Llama, DeepSeek-V2 without and DeepSeek-V3 with q compression), KV bytes per token of the two benchmark
shapes, and the decode weights a batch reads growing from the top-k experts of one row to all of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from simulator import model_cost

ROOT = Path(__file__).resolve().parents[2]


def _shape(name: str) -> dict:
    return json.loads((ROOT / "bench" / "shapes" / name / "config.json").read_text())


def _tiny_deepseek(version: int) -> dict:
    config = {
        "model_type": f"deepseek_v{version}",
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None if version == 2 else 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 2,
        "topk_group": 1,
        "tie_word_embeddings": False,
    }
    return config


def _transformers_params(config: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    # model_cost counts matmul weights: not the norms' scales nor V3's router score bias (a few thousand values)
    return sum(
        p.numel() for name, p in model.named_parameters() if "norm" not in name and "e_score_correction" not in name
    )


@pytest.mark.parametrize("version", [2, 3])
def test_deepseek_parameters_match_transformers(version) -> None:
    config = _tiny_deepseek(version)
    assert model_cost.total_params(config) == _transformers_params(config)


def test_llama_parameters_match_transformers() -> None:
    config = {**_shape("llama-8b"), "num_hidden_layers": 2, "vocab_size": 128}
    assert model_cost.total_params(config) == _transformers_params(config)


def test_the_benchmark_shapes_kv_and_active_parameters() -> None:
    llama, dsv2 = _shape("llama-8b"), _shape("dsv2-lite-chat")
    assert model_cost.kv_bytes_per_token(llama) == 131_072  # 32 layers x 2 x 8 heads x 128 x 2 bytes
    assert model_cost.kv_bytes_per_token(dsv2) == 31_104  # 27 layers x (512 + 64) x 2 bytes
    assert model_cost.matmul_params(llama) == pytest.approx(6.98e9, rel=1e-3)
    assert model_cost.matmul_params(dsv2) == pytest.approx(2.24e9, rel=1e-2)  # of 15.5B
    assert model_cost.total_params(dsv2) == pytest.approx(15.49e9, rel=1e-3)
    assert model_cost.sessions_fitting(dsv2, 100e9, 100_000) == 32
    assert model_cost.sessions_fitting(llama, 100e9, 100_000) == 7


def test_a_decode_step_reads_more_experts_as_rows_grow() -> None:
    dsv2 = _shape("dsv2-lite-chat")
    reads = [model_cost.decode_weight_params(dsv2, rows) for rows in (1, 4, 16, 64, 256)]
    assert reads == sorted(reads) and reads[0] < reads[-1]
    everything = model_cost.total_params(dsv2) - dsv2["vocab_size"] * dsv2["hidden_size"]  # not the embedding
    assert reads[-1] == pytest.approx(everything, rel=1e-3)
    dense = _shape("llama-8b")
    assert model_cost.decode_weight_params(dense, 1) == model_cost.decode_weight_params(dense, 64)
