"""The model registry: every model type the contracts table has a rank serve has its config and model classes,
and a config.json reaches its family's model class through it (llama, deepseek_v2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepseek_checkpoints import V2

from contracts.model_types import MODEL_TYPES, SERVED_MODEL_TYPES
from rank_worker.engine.factory import build_model
from rank_worker.expert_parallel.shard import WHOLE
from rank_worker.model.config import LlamaFamilyConfig
from rank_worker.model.deepseek import DeepseekForCausalLM
from rank_worker.model.deepseek_config import DeepseekConfig
from rank_worker.model.llama import LlamaForCausalLM
from rank_worker.model.registry import ARCHITECTURES, REGISTRY, model_classes
from rank_worker.model_files.opener import open_model_source

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 128,
}
TINY_DEEPSEEK_V2 = {**V2, "model_type": "deepseek_v2", "num_hidden_layers": 2}


def test_the_registry_and_the_contracts_table_cover_the_same_types() -> None:
    assert set(REGISTRY) == set(SERVED_MODEL_TYPES)
    named = {model_type.architecture for model_type in MODEL_TYPES.values()} - {None}
    assert named == set(ARCHITECTURES), "an architecture without classes, or classes no model type uses"


@pytest.mark.parametrize(
    ("hf", "config_class", "model_class"),
    [
        (TINY_LLAMA, LlamaFamilyConfig, LlamaForCausalLM),
        (TINY_DEEPSEEK_V2, DeepseekConfig, DeepseekForCausalLM),
    ],
    ids=["llama", "deepseek_v2"],
)
def test_a_config_json_reaches_its_family_model_class(tmp_path: Path, hf, config_class, model_class) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    source = open_model_source(str(tmp_path / "config.json"), "dummy")
    classes = model_classes(source.hf_config)
    assert (classes.config, classes.model) == (config_class, model_class)
    cfg = classes.config.for_serving(source.hf_config, 128)
    assert isinstance(cfg, config_class) and cfg.model_type == hf["model_type"]
    assert isinstance(classes.model(cfg, max_positions=128, shard=WHOLE), model_class)
    assert isinstance(build_model(source, torch.device("cpu"), torch.float32, 128, seed=0), model_class)


def test_a_type_the_rank_does_not_serve_is_refused_by_name() -> None:
    for model_type in ("gpt2", "deepseek_v32"):
        with pytest.raises(ValueError, match=f"model_type '{model_type}' is not supported"):
            model_classes({"model_type": model_type})
    assert model_classes({}) is REGISTRY["llama"], "a config.json without model_type is a Llama's"
