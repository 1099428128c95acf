"""Prompt rendering through the model's own template: SmolLM2's real ChatML template (Hermes tools folded
in) and a Qwen3-like template that handles tools itself (DeepSeek's format: test_deepseek_prompt.py). Stable
and prefix-stable renderings are what make the KV cache hit across turns."""

from __future__ import annotations

import itertools
import json

import pytest

from gateway.http.errors import ChatTemplateError
from gateway.parsing.events import OutputEvent, ToolCallArgumentsDelta, ToolCallStart
from gateway.parsing.pipeline import make_output_parser
from gateway.prompt.chat import ChatMessage, ChatRequest, ToolCall, ToolChoice, ToolSpec
from gateway.prompt.render import ModelTemplate, family_for, prompt_opens_reasoning, render_prompt, thinks
from rank_worker.model_files.opener import open_model_source

D = "｜DSML｜"

BASH = ToolSpec(
    "Bash",
    "Run a shell command.",
    {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"],
    },
)
READ = ToolSpec("Read", "Read a file.", {"type": "object", "properties": {"file_path": {"type": "string"}}})

# One Claude Code style session. A turn the client sends ends on a user message or on the last of a run of
# tool results (the results of parallel calls come back together).
SESSION = [
    ChatMessage("system", "You are a coding agent. Be concise."),
    ChatMessage("user", "What is in src/? Then show me main.py."),
    ChatMessage(
        "assistant",
        "Let me look.",
        reasoning="List the directory first.",
        tool_calls=[
            ToolCall("toolu_01", "Bash", {"command": "ls src/", "timeout": 30}),
            ToolCall("toolu_02", "Read", {"file_path": "src/main.py"}),
        ],
    ),
    ChatMessage("tool", "main.py\nutil.py", tool_call_id="toolu_01", tool_name="Bash"),
    ChatMessage("tool", "print('hi')", tool_call_id="toolu_02", tool_name="Read"),
    ChatMessage("assistant", "src/ holds main.py and util.py; main.py prints hi."),
    ChatMessage("user", "Run it."),
    ChatMessage("assistant", "", tool_calls=[ToolCall("toolu_03", "Bash", {"command": "python src/main.py"})]),
    ChatMessage("tool", "Traceback: boom", tool_call_id="toolu_03", tool_name="Bash", is_error=True),
]


def _ends_a_turn(i: int) -> bool:
    following = SESSION[i + 1].role if i + 1 < len(SESSION) else None
    return SESSION[i].role == "user" or (SESSION[i].role == "tool" and following != "tool")


TURN_ENDS = [i + 1 for i in range(len(SESSION)) if _ends_a_turn(i)]
assert TURN_ENDS == [2, 5, 7, 9]


def turn(end: int, **kwargs: object) -> ChatRequest:
    return ChatRequest(messages=list(SESSION[:end]), tools=[BASH, READ], **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def smollm2() -> ModelTemplate:
    bundle = open_model_source("").tokenizer
    assert bundle is not None
    return ModelTemplate.for_model(
        "HuggingFaceTB/SmolLM2-135M-Instruct", bundle.chat_template, bundle.bos_token, bundle.eos_token
    )


# SmolLM2: ChatML without tool support, so tools are folded in the Hermes way.


def test_smollm2_is_hermes_without_thinking(smollm2: ModelTemplate) -> None:
    assert smollm2.family == "hermes" and not smollm2.thinks and not smollm2.handles_tools


def test_tools_are_listed_in_the_system_section_before_the_system_text(smollm2: ModelTemplate) -> None:
    text = render_prompt(turn(2), smollm2)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools\n")
    assert system.endswith("<tool_response></tool_response> tags.\n\nYou are a coding agent. Be concise.")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in listed] == ["Bash", "Read"]
    assert json.loads(listed[0])["function"]["parameters"] == BASH.parameters
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>' in system


def test_calls_and_results_render_and_the_prompt_ends_with_the_generation_prompt(smollm2: ModelTemplate) -> None:
    text = render_prompt(turn(5), smollm2)
    assert text.endswith("<|im_start|>assistant\n")
    assert (
        "<|im_start|>assistant\nLet me look.\n"
        '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls src/", "timeout": 30}}\n</tool_call>\n'
        '<tool_call>\n{"name": "Read", "arguments": {"file_path": "src/main.py"}}\n</tool_call><|im_end|>\n'
    ) in text
    # Both results in one user turn, in order.
    assert (
        "<|im_start|>user\n<tool_response>\nmain.py\nutil.py\n</tool_response>\n"
        "<tool_response>\nprint('hi')\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    assert "List the directory first." not in text  # SmolLM2 does not think: no reasoning shown to it


def test_error_results_are_marked(smollm2: ModelTemplate) -> None:
    assert "<tool_response>\nError: Traceback: boom\n</tool_response>" in render_prompt(turn(len(SESSION)), smollm2)


def test_rendering_is_stable(smollm2: ModelTemplate) -> None:
    assert render_prompt(turn(len(SESSION)), smollm2) == render_prompt(turn(len(SESSION)), smollm2)


@pytest.mark.parametrize("family", ["smollm2", "qwen3"])
def test_each_turn_is_a_prefix_of_the_next(family: str, smollm2: ModelTemplate) -> None:
    template = {"smollm2": smollm2, "qwen3": QWEN3}[family]
    renders = [render_prompt(turn(end), template) for end in TURN_ENDS]
    for earlier, later in itertools.pairwise(renders):
        assert later.startswith(earlier)


def test_tool_choice_none_hides_the_tools(smollm2: ModelTemplate) -> None:
    text = render_prompt(turn(2, tool_choice=ToolChoice("none")), smollm2)
    assert "<tools>" not in text and "# Tools" not in text
    assert text.startswith("<|im_start|>system\nYou are a coding agent. Be concise.<|im_end|>\n")


def test_tool_choice_any_and_tool_require_a_call(smollm2: ModelTemplate) -> None:
    assert "you must call at least one of the tools" in render_prompt(turn(2, tool_choice=ToolChoice("any")), smollm2)
    text = render_prompt(turn(2, tool_choice=ToolChoice("tool", "Read")), smollm2)
    assert "you must call the tool Read" in text
    assert "must call" not in render_prompt(turn(2), smollm2)


def test_no_system_no_tools_keeps_the_template_default(smollm2: ModelTemplate) -> None:
    text = render_prompt(ChatRequest(messages=[ChatMessage("user", "Hi")]), smollm2)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_without_a_system_message_make_one(smollm2: ModelTemplate) -> None:
    text = render_prompt(ChatRequest(messages=[ChatMessage("user", "Hi")], tools=[BASH]), smollm2)
    assert text.startswith("<|im_start|>system\n# Tools\n")


def test_leading_system_messages_are_joined(smollm2: ModelTemplate) -> None:
    chat = ChatRequest(messages=[ChatMessage("system", "A."), ChatMessage("system", "B."), ChatMessage("user", "Hi")])
    assert render_prompt(chat, smollm2).startswith("<|im_start|>system\nA.\n\nB.<|im_end|>\n<|im_start|>user\nHi")


def test_system_messages_right_after_the_first_user_message_join_the_system_turn(smollm2: ModelTemplate) -> None:
    """Claude Code sends its environment there (a system message after the user's first prompt): in the system
    turn it follows the instructions every session shares; a system message later in the conversation stays."""
    chat = ChatRequest(
        messages=[
            ChatMessage("system", "Instructions."),
            ChatMessage("user", "Hi"),
            ChatMessage("system", "Environment.\nToday's date is 2026-12-01."),
            ChatMessage("assistant", "Hello"),
            ChatMessage("user", "Bye"),
            ChatMessage("system", "Later."),
        ]
    )
    assert render_prompt(chat, smollm2) == (
        "<|im_start|>system\nInstructions.\n\nEnvironment.\n\n# This session\n - Today's date is 2026-12-01."
        "<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>system\nLater.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_session_part_follows_the_tools_and_the_system_text(smollm2: ModelTemplate) -> None:
    chat = ChatRequest(
        messages=[ChatMessage("system", "Be concise.\n\nToday's date is 2026-12-01."), ChatMessage("user", "Hi")],
        tools=[BASH],
        tool_choice=ToolChoice("any"),
    )
    system = render_prompt(chat, smollm2).split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools\n")
    assert system.endswith(
        "tags.\n\nBe concise.\n\n# This session\n - Today's date is 2026-12-01.\n\n"
        "In this reply you must call at least one of the tools."
    )


def test_hermes_reasoning_is_rendered_for_models_that_think(smollm2: ModelTemplate) -> None:
    thinking = ModelTemplate(smollm2.chat_template, family="hermes", thinks=True)
    assert "<|im_start|>assistant\n<think>\nList the directory first.\n</think>\n\nLet me look.\n<tool_call>" in (
        render_prompt(turn(4), thinking)
    )


def test_rendered_calls_parse_back_to_the_same_calls(smollm2: ModelTemplate) -> None:
    # What we show the model as its own past calls is exactly the markup the output parser reads.
    text = render_prompt(turn(4), smollm2)
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parsed_calls("hermes", assistant) == [(c.name, c.arguments) for c in SESSION[2].tool_calls]


# A Qwen3-like template: tools, tool calls, tool results and reasoning handled by the template itself.

QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\n' }}{% endif %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
QWEN3 = ModelTemplate.for_model("Qwen/Qwen3-8B", QWEN3_TEMPLATE, eos_token="<|im_end|>")


def test_qwen3_like_template_gets_hugging_face_structures() -> None:
    assert QWEN3.handles_tools and QWEN3.thinks and QWEN3.family == "hermes"
    text = render_prompt(turn(5), QWEN3)
    assert text.startswith("<|im_start|>system\nYou are a coding agent. Be concise.\n\n# Tools\n<tools>\n")
    tool_line = text.split("<tools>\n")[1].splitlines()[0]
    assert json.loads(tool_line) == {
        "type": "function",
        "function": {"name": "Bash", "description": BASH.description, "parameters": BASH.parameters},
    }
    assert (
        "<|im_start|>assistant\n<think>\nList the directory first.\n</think>\n\nLet me look.\n<tool_call>\n"
        '{"name": "Bash", "arguments": {"command": "ls src/", "timeout": 30}}\n</tool_call>'
    ) in text
    assert "<|im_start|>user\n<tool_response>\nmain.py\nutil.py\n</tool_response>\n<tool_response>\nprint('hi')" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_like_template_tool_choice_none_and_thinking_off() -> None:
    text = render_prompt(turn(2, tool_choice=ToolChoice("none"), reasoning=False), QWEN3)
    assert "<tools>" not in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning(text)


def test_qwen3_like_template_required_tool_goes_into_the_system_message() -> None:
    text = render_prompt(turn(2, tool_choice=ToolChoice("tool", "Bash")), QWEN3)
    assert text.startswith("<|im_start|>system\nYou are a coding agent. Be concise.\n\nIn this reply you must call")


def test_qwen3_like_template_gets_the_session_part_after_the_tools() -> None:
    chat = ChatRequest(
        messages=[ChatMessage("system", "Be concise.\n\nToday's date is 2026-12-01."), ChatMessage("user", "Hi")],
        tools=[BASH],
    )
    text = render_prompt(chat, QWEN3)
    assert text.startswith("<|im_start|>system\nBe concise.\n\n# Tools\n<tools>\n")
    assert text.endswith(
        "</tools><|im_end|>\n<|im_start|>system\n# This session\n - Today's date is 2026-12-01.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_refusing_a_second_system_message_gets_the_session_part_in_the_first() -> None:
    refusing = QWEN3_TEMPLATE.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('one system') }}"
        "{% endif %}",
    )
    chat = ChatRequest(
        messages=[ChatMessage("system", "Be concise.\n\nToday's date is 2026-12-01."), ChatMessage("user", "Hi")],
        tools=[BASH],
    )
    text = render_prompt(chat, ModelTemplate.for_model("Qwen/Qwen3-8B", refusing))
    assert text.startswith(
        "<|im_start|>system\nBe concise.\n\n# This session\n - Today's date is 2026-12-01.\n\n# Tools"
    )


# DeepSeek's format is written without the template: tests/gateway/test_deepseek_prompt.py.


def parsed_calls(family: str, text: str) -> list[tuple[str, dict[str, object]]]:
    parser = make_output_parser(family, thinks=False)
    events: list[OutputEvent] = parser.feed(text) + parser.finish()
    names = [e.name for e in events if isinstance(e, ToolCallStart)]
    arguments: dict[int, str] = {}
    for event in events:
        if isinstance(event, ToolCallArgumentsDelta):
            arguments[event.index] = arguments.get(event.index, "") + event.fragment
    return [(name, json.loads(arguments[i])) for i, name in enumerate(names)]


# Family and thinking detection.


def test_family_for() -> None:
    assert family_for("HuggingFaceTB/SmolLM2-135M-Instruct", "", None) == "hermes"
    assert family_for("Qwen/Qwen3-8B", QWEN3_TEMPLATE, {"<tool_call>", "<think>"}) == "hermes"
    assert family_for("deepseek-ai/DeepSeek-V3.2-Exp", "", None) == "deepseek_dsml"
    assert family_for("deepseek-ai/DeepSeek-V4", "", None) == "deepseek_dsml"
    assert family_for("deepseek-ai/DeepSeek-V3", "", None) == "hermes"
    assert family_for("my-finetune", "", {f"<{D}invoke"}) == "deepseek_dsml"
    assert family_for("/models/local", "", None, "deepseek_v2") == "deepseek_dsml"
    assert family_for("/models/local", "", None, "llama") == "hermes"


def test_thinks() -> None:
    assert not thinks("HuggingFaceTB/SmolLM2-135M-Instruct", "{{ messages }}", {"<|im_start|>"})
    assert thinks("Qwen/Qwen3-8B", "{% if enable_thinking %}{% endif %}", None)
    assert thinks("x", "<think>", None)
    assert thinks("x", "", {"<think>", "</think>"})


def test_unknown_family_and_refusing_templates() -> None:
    with pytest.raises(ValueError, match="unknown model family"):
        ModelTemplate("", family="mistral")
    refusing = ModelTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_prompt(turn(2), refusing)
