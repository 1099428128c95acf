"""Which markup a model was trained to use for tool calls, and whether it thinks out loud first."""

from __future__ import annotations

import re

from contracts.model_types import DEEPSEEK_DSML, HERMES, prompt_family_of

_DSML = "｜DSML｜"
_DSML_MODEL = re.compile(r"deepseek.*(v3[._-]?2|v4)", re.IGNORECASE)
_DEEPSEEK_TEMPLATE_MARKERS = ("<｜Assistant｜>", "'Assistant:")  # V2.5 and later; V2(-Lite)-Chat


def family_for(model_id: str, chat_template: str, vocab: set[str] | None = None, model_type: str = "") -> str:
    """ "deepseek_dsml" for the DeepSeek family (DeepSeek's turn markers, DSML tool calls), else "hermes"
    (<tool_call> JSON).

    The architecture the rank reports (model_type) decides first, where the model types' table
    (contracts/model_types.py) fixes its family: a DeepSeek checkpoint served from a local path, or with another
    model's tokenizer (a benchmark shape), names its family nowhere else. Otherwise DSML in the template or
    vocabulary, or a V3.2/V4 model id, says DeepSeek. Hermes is the default: Qwen and SmolLM2 use it, and a
    model trained on neither follows its instructions in the system prompt more readily than DSML's."""
    family = prompt_family_of(model_type)
    if family is not None:
        return family
    if _DSML in chat_template or (vocab is not None and any(_DSML in token for token in vocab)):
        return DEEPSEEK_DSML
    if _DSML_MODEL.search(model_id):
        return DEEPSEEK_DSML
    return HERMES


def thinks(model_id: str, chat_template: str, vocab: set[str] | None = None, family: str = HERMES) -> bool:
    """Whether the model may open its answers with <think> reasoning (SmolLM2: no; Qwen3, DeepSeek R1, V3.1,
    V3.2: yes)."""
    if "<think>" in chat_template or "enable_thinking" in chat_template:
        return True
    if family == DEEPSEEK_DSML and any(marker in chat_template for marker in _DEEPSEEK_TEMPLATE_MARKERS):
        return False  # DeepSeek's own template without <think> (V2, V3): V3's vocabulary has it for R1's sake
    return vocab is not None and "<think>" in vocab


def prompt_opens_reasoning(prompt: str) -> bool:
    """The rendered prompt ends inside <think> (Qwen3 thinking variants, DeepSeek thinking mode): the
    output starts as reasoning."""
    return prompt.rstrip().endswith("<think>")
