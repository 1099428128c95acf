"""Render a model's chat template (Jinja, Hugging Face conventions) into the prompt text it was trained on."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.http.errors import ChatTemplateError


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON, as transformers renders it.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    # Templates arrive from model files: the sandbox keeps them from reaching Python internals.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """The prompt text for `messages` ([{role, content}, ...]); raises ChatTemplateError with the
    template's own message when it refuses them."""
    if not template:
        raise ChatTemplateError("the model has no chat template; use --raw to send the prompt as is")
    try:
        compiled = _environment().from_string(template)
        return compiled.render(
            messages=[dict(message) for message in messages],
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
