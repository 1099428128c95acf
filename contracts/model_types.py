"""The model types kvserve knows, by config.json `model_type`: the one table of them.

Each says which architecture's model code the rank worker serves it with (rank_worker/model/registry.py maps an
architecture to its config and model classes) and, where the architecture fixes it, the prompt markup the model
was trained on (the gateway renders prompts and parses tool calls in it, taking the model type the rank reports
in DescribeModel). Adding a family: its rows here, its classes in the rank worker's registry, its model code.
"""

from __future__ import annotations

from dataclasses import dataclass

# Architectures: the rank worker's model code for a type (rank_worker/model/registry.py).
LLAMA = "llama"  # GQA attention, dense MLP (llama.py)
DEEPSEEK = "deepseek"  # MLA attention over a compressed latent KV, MoE feed-forward (deepseek.py)

# Prompt families: the markup of turns and tool calls (gateway/prompt/).
HERMES = "hermes"  # <tool_call> JSON in the model's chat template
DEEPSEEK_DSML = "deepseek_dsml"  # DeepSeek's turn markers, DSML tool calls
PROMPT_FAMILIES = (HERMES, DEEPSEEK_DSML)


@dataclass(frozen=True)
class ModelType:
    # The architecture the rank worker serves it with; None: known by its markup only, the rank refuses it.
    architecture: str | None
    # The markup its checkpoints share whatever their template; None: the chat template tells (hermes unless
    # it shows DSML).
    prompt_family: str | None = None


MODEL_TYPES: dict[str, ModelType] = {
    "llama": ModelType(LLAMA),
    "mistral": ModelType(LLAMA),
    "qwen2": ModelType(LLAMA),
    "qwen3": ModelType(LLAMA),
    "smollm2": ModelType(LLAMA),
    "smollm3": ModelType(LLAMA),
    # V2 and V2.5; V3 and V3.1 (and R1).
    "deepseek_v2": ModelType(DEEPSEEK, DEEPSEEK_DSML),
    "deepseek_v3": ModelType(DEEPSEEK, DEEPSEEK_DSML),
    # V3.2's sparse attention is not implemented: a rank refuses it, its markup is DSML all the same.
    "deepseek_v32": ModelType(None, DEEPSEEK_DSML),
}

# What a rank worker loads, in the table's order (the message naming them when a config.json is refused).
SERVED_MODEL_TYPES = tuple(name for name, model_type in MODEL_TYPES.items() if model_type.architecture)


def architecture_of(model_type: str) -> str | None:
    """The architecture a rank worker serves this config.json model_type with; None if it serves none."""
    known = MODEL_TYPES.get(model_type)
    return known.architecture if known else None


def prompt_family_of(model_type: str) -> str | None:
    """The prompt family this model type's checkpoints share; None where only the chat template can tell
    (a Llama-family type, an unknown or unreported one)."""
    known = MODEL_TYPES.get(model_type)
    return known.prompt_family if known else None
