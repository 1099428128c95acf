"""Which config and model classes serve a config.json's model_type: contracts/model_types.py names each type's
architecture, this maps an architecture to its classes. Every family offers the same three calls, so the engine's
factory builds any of them alike:

    classes = model_classes(hf_config)
    cfg = classes.config.for_serving(hf_config, max_positions)  # refuses what our code would get wrong
    model = classes.model(cfg, max_positions, shard)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contracts.model_types import DEEPSEEK, LLAMA, MODEL_TYPES, SERVED_MODEL_TYPES
from rank_worker.model.config import LlamaFamilyConfig
from rank_worker.model.deepseek import DeepseekForCausalLM
from rank_worker.model.deepseek_config import DeepseekConfig
from rank_worker.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ModelClasses:
    config: type[LlamaFamilyConfig] | type[DeepseekConfig]
    model: type[LlamaForCausalLM] | type[DeepseekForCausalLM]


ARCHITECTURES: dict[str, ModelClasses] = {
    LLAMA: ModelClasses(LlamaFamilyConfig, LlamaForCausalLM),
    DEEPSEEK: ModelClasses(DeepseekConfig, DeepseekForCausalLM),
}

# model_type -> its classes, for every type the contracts table has a rank serve (a KeyError here at import: an
# architecture the table names has no classes).
REGISTRY: dict[str, ModelClasses] = {name: ARCHITECTURES[MODEL_TYPES[name].architecture] for name in SERVED_MODEL_TYPES}


def model_classes(hf: dict[str, Any]) -> ModelClasses:
    """The classes of a normalized config.json's model_type (a config without one is a Llama's); ValueError
    naming the served types for any other."""
    model_type = str(hf.get("model_type", "llama"))
    if model_type not in REGISTRY:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SERVED_MODEL_TYPES)})")
    return REGISTRY[model_type]
