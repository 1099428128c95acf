"""Which markup a model was trained to use for tool calls, and whether it thinks out loud first."""

from __future__ import annotations

import re

FAMILIES = ("hermes", "deepseek_dsml")
_DSML = "｜DSML｜"
_DSML_MODEL = re.compile(r"deepseek.*(v3[._-]?2|v4)", re.IGNORECASE)


def family_for(model_id: str, chat_template: str, vocab: set[str] | None = None) -> str:
    """ "deepseek_dsml" for DeepSeek V3.2 and later (DSML markup), else "hermes" (<tool_call> JSON).

    Hermes is the default: Qwen and SmolLM2 use it, and a model trained on neither follows its
    instructions in the system prompt more readily than DSML's."""
    if _DSML in chat_template or (vocab is not None and any(_DSML in token for token in vocab)):
        return "deepseek_dsml"
    if _DSML_MODEL.search(model_id):
        return "deepseek_dsml"
    return "hermes"


def thinks(model_id: str, chat_template: str, vocab: set[str] | None = None) -> bool:
    """Whether the model may open its answers with <think> reasoning (SmolLM2: no; Qwen3, DeepSeek: yes)."""
    if "<think>" in chat_template or "enable_thinking" in chat_template:
        return True
    return vocab is not None and "<think>" in vocab


def prompt_opens_reasoning(prompt: str) -> bool:
    """The rendered prompt ends inside <think> (Qwen3 thinking variants, DeepSeek thinking mode): the
    output starts as reasoning."""
    return prompt.rstrip().endswith("<think>")
