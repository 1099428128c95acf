"""The chat template renderer: Hugging Face conventions, template errors surfaced, sandboxed."""

from __future__ import annotations

import pytest

from gateway.http.errors import ChatTemplateError
from gateway.prompt.chat_template import render_chat

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nDefault.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chatml_with_system_and_generation_prompt() -> None:
    text = render_chat(CHATML, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_template_default_system_and_no_generation_prompt() -> None:
    text = render_chat(CHATML, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert text == "<|im_start|>system\nDefault.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_bos_and_eos_tokens_are_template_variables() -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    assert render_chat(template, [{"role": "user", "content": "x"}], bos_token="<s>", eos_token="</s>") == "<s>x</s>"


def test_raise_exception_surfaces_the_template_message() -> None:
    template = (
        "{% for m in messages %}{% if m.role not in ['user'] %}"
        "{{ raise_exception('only user turns') }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="only user turns"):
        render_chat(template, [{"role": "tool", "content": "x"}])


def test_tojson_keeps_unicode_and_html_as_is() -> None:
    template = "{{ messages[0] | tojson }}"
    assert render_chat(template, [{"role": "user", "content": "<é>"}]) == '{"role": "user", "content": "<é>"}'


def test_empty_template_asks_for_raw() -> None:
    with pytest.raises(ChatTemplateError, match="--raw"):
        render_chat("", [{"role": "user", "content": "x"}])


def test_syntax_error_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])


def test_templates_cannot_reach_python_internals() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat("{{ ().__class__.__base__.__subclasses__() }}", [{"role": "user", "content": "x"}])
