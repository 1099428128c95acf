"""Config features the model code does not implement are refused at load, naming the feature, instead of
loading and giving wrong logits; configs whose features are off, or harmless at the max_model_len in effect,
load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from engine_fixtures import write_word_tokenizer

from contracts.config import KvServeConfig
from rank_worker.engine.factory import build_engine, build_model
from rank_worker.model.feature_check import UnsupportedModelError, check_supported, unsupported_features
from rank_worker.model_files.hf_config import normalize_hf_config
from rank_worker.model_files.opener import open_model_source

SHAPE = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

# As published on the hub (trimmed to the keys that matter here).
MISTRAL_7B_V01 = {"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}
QWEN25_7B = {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28}
SMOLLM3_3B = {
    "model_type": "smollm3",
    "use_sliding_window": False,
    "sliding_window": None,
    "no_rope_layer_interval": 4,
    "no_rope_layers": [1, 1, 1, 0],
}


def config(**keys: Any) -> dict[str, Any]:
    return normalize_hf_config({**SHAPE, **keys})


def test_sliding_window_below_max_model_len_is_refused_with_the_fix() -> None:
    with pytest.raises(UnsupportedModelError) as refused:
        check_supported(config(**MISTRAL_7B_V01), max_model_len=32768)
    assert str(refused.value) == (
        "this mistral model cannot be served: sliding-window attention (sliding_window=4096 < "
        "max_model_len=32768) is not implemented; set max_model_len <= 4096"
    )
    check_supported(config(**MISTRAL_7B_V01), max_model_len=4096)  # the window spans the whole context


def test_windows_that_are_off_or_cover_the_context_are_accepted() -> None:
    check_supported(config(**QWEN25_7B), max_model_len=32768)  # use_sliding_window: false
    check_supported(config(model_type="mistral", sliding_window=None), max_model_len=32768)  # v0.2 and later
    check_supported(config(**SMOLLM3_3B), max_model_len=65536)
    # Qwen2 slides only from layer max_window_layers on: none of the 4 layers here.
    check_supported(config(model_type="qwen2", use_sliding_window=True, sliding_window=64), max_model_len=512)
    # Llama has no sliding window: transformers ignores the key, and so do we.
    check_supported(config(model_type="llama", sliding_window=64), max_model_len=512)


@pytest.mark.parametrize(
    "keys",
    [
        {"model_type": "mistral"},  # MistralConfig's default window is 4096
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
        {
            "model_type": "qwen3",
            "use_sliding_window": True,
            "sliding_window": 64,
            "layer_types": ["sliding_attention"] * 4,
        },
        {"model_type": "smollm3", "use_sliding_window": True, "sliding_window": 64},  # its NoPE layers slide
    ],
)
def test_every_family_s_sliding_windows_are_found(keys: dict[str, Any]) -> None:
    problems = unsupported_features(config(**keys), max_model_len=8192)
    assert len(problems) == 1 and problems[0].startswith("sliding-window attention"), problems


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not implemented"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic' is not implemented"),
        ({"partial_rotary_factor": 0.5}, "partial rotary embedding (partial_rotary_factor=0.5)"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}}, "partial_rotary_factor=0.25"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not implemented"),
        ({"mlp_bias": True}, "MLP biases (mlp_bias: true)"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoints (quantization_config: fp8)"),
        ({"layer_types": ["linear_attention"] * 4, "model_type": "qwen3"}, "layer types linear_attention"),
        ({"model_type": "smollm3", "no_rope_layers": [1, 0]}, "no_rope_layers lists 2 layers for 4"),
    ],
)
def test_features_the_model_code_would_ignore_are_named(keys: dict[str, Any], named: str) -> None:
    problems = unsupported_features(config(**keys), max_model_len=512)
    assert any(named in problem for problem in problems), problems


def test_supported_configs_have_no_problems() -> None:
    for keys in (
        {},
        {"model_type": "qwen2"},  # q/k/v bias by default, no o_proj bias: implemented
        {"model_type": "qwen3"},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"hidden_act": "silu", "mlp_bias": False, "attention_bias": False},
        {"attention_bias": True},  # q/k/v and o_proj biases: implemented (test_model_parity)
        {"model_type": "qwen3", "mlp_bias": True},  # Qwen3 has no MLP bias, whatever the config says
    ):
        assert unsupported_features(config(**keys), max_model_len=512) == [], keys


def _write_mistral(directory: Path, sliding_window: int) -> Path:
    cfg = transformers.MistralConfig(**SHAPE, sliding_window=sliding_window, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.MistralForCausalLM(cfg).save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory, SHAPE["vocab_size"])
    return directory


def test_a_windowed_mistral_is_refused_at_load_not_served_wrong(tmp_path: Path) -> None:
    """Through the real loader: with max_model_len defaulting to the trained 512 the window of 16 is refused
    before any weight is read, and a max_model_len within the window loads."""
    directory = _write_mistral(tmp_path / "mistral", sliding_window=16)
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=16 < max_model_len=512\) is not implemented"):
        build_engine(KvServeConfig(model=str(directory), device="cpu", num_kv_blocks=8))
    engine = build_engine(KvServeConfig(model=str(directory), device="cpu", num_kv_blocks=8, max_model_len=16))
    assert engine.model_info.max_model_len == 16
    # Random weights of the same config are refused the same way (load_format dummy reads the config alone).
    dummy = open_model_source(str(directory / "config.json"))
    with pytest.raises(UnsupportedModelError, match="sliding-window attention"):
        build_model(dummy, torch.device("cpu"), torch.float32, max_positions=512, seed=0)
