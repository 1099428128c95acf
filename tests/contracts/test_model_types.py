"""The model types' table: which a rank serves, and the prompt family the gateway takes from a reported type."""

from __future__ import annotations

from contracts.model_types import (
    DEEPSEEK,
    DEEPSEEK_DSML,
    LLAMA,
    MODEL_TYPES,
    PROMPT_FAMILIES,
    SERVED_MODEL_TYPES,
    architecture_of,
    prompt_family_of,
)


def test_deepseek_types_fix_their_prompt_family_and_llama_types_leave_it_to_the_template() -> None:
    for model_type in ("deepseek_v2", "deepseek_v3", "deepseek_v32"):
        assert prompt_family_of(model_type) == DEEPSEEK_DSML
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "smollm2", "smollm3", "", "gpt2"):
        assert prompt_family_of(model_type) is None
    assert {t.prompt_family for t in MODEL_TYPES.values()} - {None} <= set(PROMPT_FAMILIES)


def test_served_types_and_their_architectures() -> None:
    assert SERVED_MODEL_TYPES == (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "smollm2",
        "smollm3",
        "deepseek_v2",
        "deepseek_v3",
    )
    assert architecture_of("qwen3") == LLAMA and architecture_of("deepseek_v3") == DEEPSEEK
    assert architecture_of("deepseek_v32") is None and architecture_of("gpt2") is None
