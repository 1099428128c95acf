"""DeepSeek's chat format (gateway/prompt/deepseek_prompt.py) over a Claude Code-like tool loop
(tests/gateway/data/deepseek/claude_code_session.json): the prompt the gateway writes for each kind of
DeepSeek deployment, checked against recorded text (data/deepseek/*.prompt.txt), and prefix stability the
way the KV cache needs it: each request's prompt starts with the previous prompt plus the model's output,
as text and as tokens, with DeepSeek's special tokens and with a tokenizer that lacks them (the benchmark
shape's SmolLM2 tokenizer).

To rewrite the recorded prompts after a deliberate format change: KVSERVE_WRITE_GOLDEN=1 pytest <this file>.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from gateway.api.anthropic.convert import to_chat
from gateway.api.anthropic.respond import MessageBuilder
from gateway.api.anthropic.schema import MessagesRequest
from gateway.parsing.pipeline import make_output_parser
from gateway.prompt.chat import ChatMessage, ChatRequest, ToolCall, ToolChoice, ToolSpec
from gateway.prompt.deepseek_prompt import PLAIN_V2_MARKERS, SPECIAL_MARKERS, deepseek_prompt, markers_for
from gateway.prompt.family import prompt_opens_reasoning
from gateway.prompt.prompt_format import PromptFormat
from gateway.prompt.served_model import ServedModel
from gateway.ranks.generation import Finish, Usage
from protos import rank_worker_pb2 as pb
from rank_worker.engine.interface import ModelInfo, TokenizerBundle
from rank_worker.model_files.opener import open_model_source
from rank_worker.servicer import model_info_message

DATA = Path(__file__).parent / "data" / "deepseek"
SESSION = json.loads((DATA / "claude_code_session.json").read_text())
D = "｜DSML｜"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
V3_TOKENS = (BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")  # V3, V3.1, V3.2 and R1 share them
V2_TOKENS = (BOS, EOS)

# DeepSeek's own templates, as far as the format choice reads them (markers_for): V3's writes the special
# markers, V2-Lite-Chat's plain "User: " / "Assistant:" text.
V3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
V2_LITE_CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@dataclass(frozen=True)
class Deployment:
    """One way a DeepSeek model reaches the gateway: what its rank reports in ModelInfoResponse."""

    model_type: str
    chat_template: str  # "smollm2": the embedded SmolLM2 template (the benchmark shape's)
    deepseek_tokens: tuple[str, ...]  # DeepSeek's special tokens the tokenizer has (besides SmolLM2's)
    thinking: bool  # the client asks for thinking
    reply_space: bool = False  # V2's plain markers: the model's reply starts with a space


DEPLOYMENTS = {
    # V3.2 ships no Jinja template; its tokenizer has <think>: thinking model, thinking asked for.
    "v32_thinking": Deployment("deepseek_v32", "", deepseek_tokens=V3_TOKENS, thinking=True),
    # V3 with its own template (which knows no <think>, though the vocabulary has it): a model that does not think.
    "v3_chat": Deployment("deepseek_v3", V3_TEMPLATE, deepseek_tokens=V3_TOKENS, thinking=True),
    # bench/shapes/dsv2-lite-chat: DeepSeek-V2-Lite's config with SmolLM2's tokenizer and ChatML template.
    "bench_shape": Deployment("deepseek_v2", "smollm2", deepseek_tokens=(), thinking=True),
    "v2_lite_chat": Deployment(
        "deepseek_v2", V2_LITE_CHAT_TEMPLATE, deepseek_tokens=V2_TOKENS, thinking=False, reply_space=True
    ),
}


@cache
def smollm2_bundle() -> TokenizerBundle:
    bundle = open_model_source("").tokenizer
    assert bundle is not None
    return bundle


def served(deployment: Deployment) -> ServedModel:
    smollm2 = smollm2_bundle()
    tokenizer_json, bos, eos = smollm2.tokenizer_json, smollm2.bos_token, smollm2.eos_token
    if deployment.deepseek_tokens:
        tokenizer = Tokenizer.from_str(tokenizer_json)
        tokenizer.add_special_tokens(list(deployment.deepseek_tokens))
        tokenizer_json, bos, eos = tokenizer.to_str(), BOS, EOS
    template = smollm2.chat_template if deployment.chat_template == "smollm2" else deployment.chat_template
    info = pb.ModelInfoResponse(
        served_model_name="deepseek",
        model_id="/models/local-checkpoint",  # a local path: the id names no family
        max_model_len=1 << 20,
        tokenizer_json=tokenizer_json,
        chat_template=template,
        bos_token_id=-1,
        bos_token=bos,
        eos_token=eos,
        model_type=deployment.model_type,
    )
    return ServedModel.from_info(info)


def model_output(deployment: Deployment, recorded: str) -> str:
    """The recorded thinking-mode output as this deployment's model writes it."""
    if deployment.thinking and PromptFormat.for_model(served(deployment)).template.thinks:
        return recorded
    answer = recorded.split("</think>", 1)[1]
    return " " + answer if deployment.reply_space and not answer[0].isspace() else answer


def new_ids() -> Any:
    counter = itertools.count(1)
    return lambda: f"toolu_{next(counter):024d}"


def anthropic_reply(prompt_format: PromptFormat, prompt: str, output: str) -> dict[str, Any]:
    """The Anthropic message the gateway makes of `output`."""
    template = prompt_format.template
    parser = make_output_parser(template.family, template.thinks, prompt_opens_reasoning(prompt), new_ids())
    builder = MessageBuilder("msg_1", "deepseek")
    for event in parser.feed(output) + parser.finish():
        builder.add(event)
    builder.add(Finish("stop", Usage()))
    return builder.result()


@dataclass
class Turn:
    prompt: str
    output: str


def play_session(deployment: Deployment) -> tuple[list[Turn], str]:
    """Each request of the session as Claude Code would send it, the model answering with the recorded
    outputs; returns the turns and the prompt of the request after the last one."""
    prompt_format = PromptFormat.for_model(served(deployment))
    body: dict[str, Any] = {
        "model": "deepseek",
        "max_tokens": 4096,
        "system": SESSION["system"],
        "tools": SESSION["tools"],
        "messages": [{"role": "user", "content": SESSION["first_user"]}],
    }
    if deployment.thinking:
        body["thinking"] = {"type": "enabled", "budget_tokens": 2048}
    turns = []
    for recorded in SESSION["turns"]:
        prompt = prompt_format.render(to_chat(MessagesRequest.model_validate(body)))
        output = model_output(deployment, recorded["output"])
        reply = anthropic_reply(prompt_format, prompt, output)
        body["messages"].append({"role": "assistant", "content": reply["content"]})
        if "results" in recorded:
            calls = [block for block in reply["content"] if block["type"] == "tool_use"]
            assert len(calls) == len(recorded["results"])
            content = [
                {"type": "tool_result", "tool_use_id": call["id"], **result}
                for call, result in zip(calls, recorded["results"], strict=True)
            ]
        else:
            content = recorded["user"]
        body["messages"].append({"role": "user", "content": content})
        turns.append(Turn(prompt, output))
    return turns, prompt_format.render(to_chat(MessagesRequest.model_validate(body)))


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def session(request: pytest.FixtureRequest) -> tuple[str, list[Turn], str]:
    turns, last = play_session(DEPLOYMENTS[request.param])
    return request.param, turns, last


def test_the_session_renders_to_the_recorded_prompt(session: tuple[str, list[Turn], str]) -> None:
    name, _, last = session
    golden = DATA / f"{name}.prompt.txt"
    if os.environ.get("KVSERVE_WRITE_GOLDEN"):
        golden.write_text(last)
    assert last == golden.read_text(), f"{golden.name} differs; KVSERVE_WRITE_GOLDEN=1 rewrites it"


def test_each_prompt_starts_with_the_previous_prompt_and_its_output(session: tuple[str, list[Turn], str]) -> None:
    _, turns, last = session
    prompts = [turn.prompt for turn in turns] + [last]
    for turn, following in zip(turns, prompts[1:], strict=True):
        assert following.startswith(turn.prompt + turn.output)


def test_each_prompt_starts_with_the_previous_prompt_and_its_output_as_tokens(
    session: tuple[str, list[Turn], str],
) -> None:
    """What the KV cache holds after a turn: the prompt's tokens, then the tokens the model wrote (the
    model's own tokens: the tokenizer's encoding of its text, as greedy BPE output is)."""
    name, turns, last = session
    model = served(DEPLOYMENTS[name])
    prompts = [turn.prompt for turn in turns] + [last]
    for turn, following in zip(turns, prompts[1:], strict=True):
        held = model.encode(turn.prompt) + model.tokenizer.encode(turn.output, add_special_tokens=False).ids
        assert model.encode(following)[: len(held)] == held


def test_the_family_comes_from_the_model_type_whatever_the_template() -> None:
    for name, deployment in DEPLOYMENTS.items():
        assert PromptFormat.for_model(served(deployment)).template.family == "deepseek_dsml", name
    llama = served(Deployment("llama", "smollm2", deepseek_tokens=(), thinking=False))
    assert PromptFormat.for_model(llama).template.family == "hermes"


def test_the_rank_reports_its_model_type() -> None:
    info = ModelInfo("m", "/models/local", 100, 64, 64, 16, b"ns", None, model_type="deepseek_v2")
    assert model_info_message(info).model_type == "deepseek_v2"


def test_markers_follow_the_models_own_template() -> None:
    assert markers_for(V3_TEMPLATE) is SPECIAL_MARKERS
    assert markers_for(V2_LITE_CHAT_TEMPLATE) is PLAIN_V2_MARKERS
    assert markers_for("") is SPECIAL_MARKERS  # V3.2: no template
    assert (
        markers_for(smollm2_bundle().chat_template) is SPECIAL_MARKERS
    )  # not DeepSeek's: DeepSeek's markers all the same


def test_markers_are_special_tokens_or_plain_text_by_tokenizer() -> None:
    with_tokens = served(DEPLOYMENTS["v32_thinking"])
    plain = served(DEPLOYMENTS["bench_shape"])
    for marker in (BOS, "<｜User｜>", "<｜Assistant｜>", EOS):
        assert len(with_tokens.encode(marker)) == 1
        assert len(plain.encode(marker)) > 1


def test_v32_layout() -> None:
    turns, last = play_session(DEPLOYMENTS["v32_thinking"])
    # The attribution header is gone, the system text follows the tools (what every session shares comes first).
    assert last.startswith(BOS + "## Tools\n\n")
    assert "x-anthropic-billing-header" not in last
    assert "\n</functions>\n\nYou are Claude Code, an interactive CLI tool" in last
    assert "Be concise.<｜User｜>" in last
    # The first request: one user turn (both text blocks), the reply opened in thinking mode.
    assert turns[0].prompt.endswith(
        "<｜User｜><system-reminder>\nThe working directory is /repo.\n</system-reminder>\n\nThe greeting in "
        'src/app.py is wrong: it should say "héllo ✓". Fix it and run the tests.<｜Assistant｜><think>'
    )
    # Calls end the reply; the results follow it, in order, and the reply after them opens with <think>.
    assert (f"</{D}function_calls>{EOS}\n\n<function_results>\n<result>     1\tdef greet") in last
    assert (
        '\n<result>test_app.py\ntests/test_app.py:4:    assert greet("x") == "hello x"</result>\n</function_results>'
        "\n\n<think>The greeting" in last
    )
    assert "<result>Error: <tool_use_error>String to replace not found in file.</tool_use_error></result>" in last
    # Earlier reasoning stays, on every turn.
    assert "<｜Assistant｜><think>The user wants the greeting fixed." in last
    assert last.endswith(
        "<result>The file /repo/tests/test_app.py has been updated.</result>\n</function_results>\n\n<think>"
    )


# The renderer on conversations of its own.

BASH = ToolSpec("Bash", "Run a command.", {"type": "object", "properties": {"command": {"type": "string"}}})


def test_no_system_and_no_tools() -> None:
    chat = ChatRequest(messages=[ChatMessage("user", "Hi")])
    assert deepseek_prompt(chat) == BOS + "<｜User｜>Hi<｜Assistant｜>"
    assert deepseek_prompt(chat, thinks=True) == BOS + "<｜User｜>Hi<｜Assistant｜></think>"
    assert deepseek_prompt(chat, PLAIN_V2_MARKERS) == BOS + "User: Hi\n\nAssistant:"


def test_the_system_message_after_the_first_user_message_joins_the_system_text() -> None:
    """Claude Code's environment (a system message after the first prompt): DeepSeek has no marker for a system
    turn there; it follows the system text, the date in the session's part at its end, after the tools."""
    chat = ChatRequest(
        [
            ChatMessage("system", "Instructions."),
            ChatMessage("user", "Hi"),
            ChatMessage("system", "Environment.\n\nToday's date is 2026-12-01."),
        ],
        tools=[BASH],
    )
    prompt = deepseek_prompt(chat)
    assert prompt.startswith(BOS + "## Tools\n\n")
    assert prompt.endswith(
        "</functions>\n\nInstructions.\n\nEnvironment.\n\n# This session\n - Today's date is 2026-12-01."
        "<｜User｜>Hi<｜Assistant｜>"
    )


def test_tool_choice() -> None:
    def render(choice: ToolChoice) -> str:
        return deepseek_prompt(ChatRequest([ChatMessage("user", "Hi")], tools=[BASH], tool_choice=choice))

    assert "## Tools" not in render(ToolChoice("none"))
    assert render(ToolChoice("any")).endswith(
        "In this reply you must call at least one of the tools.<｜User｜>Hi<｜Assistant｜>"
    )
    assert "you must call the tool Bash" in render(ToolChoice("tool", "Bash"))


def test_reasoning_is_shown_once_kept_and_only_to_models_that_think() -> None:
    history = [
        ChatMessage("user", "A"),
        ChatMessage("assistant", "One.", reasoning="Think A."),
        ChatMessage("user", "B"),
        ChatMessage("assistant", "Two."),  # a reply without reasoning (thinking was off, or the client dropped it)
        ChatMessage("user", "C"),
    ]
    on = deepseek_prompt(ChatRequest(history, reasoning=True), thinks=True)
    off = deepseek_prompt(ChatRequest(history, reasoning=False), thinks=True)
    shown = f"<｜User｜>A<｜Assistant｜><think>Think A.</think>One.{EOS}<｜User｜>B<｜Assistant｜></think>Two."
    # The history renders the same whatever this request's thinking: only the generation prompt follows it.
    assert on == BOS + shown + f"{EOS}<｜User｜>C<｜Assistant｜><think>"
    assert off == BOS + shown + f"{EOS}<｜User｜>C<｜Assistant｜></think>"
    assert "Think A." not in deepseek_prompt(ChatRequest(history, reasoning=True), thinks=False)


def test_results_after_a_non_thinking_reply_reopen_with_the_assistant_marker() -> None:
    chat = ChatRequest(
        [
            ChatMessage("user", "Go"),
            ChatMessage("assistant", "", tool_calls=[ToolCall("toolu_1", "Bash", {"command": "ls"})]),
            ChatMessage("tool", "a.txt", tool_call_id="toolu_1"),
        ],
        tools=[BASH],
    )
    text = deepseek_prompt(chat)
    assert text.endswith(
        f'<｜User｜>Go<｜Assistant｜>\n\n<{D}function_calls>\n<{D}invoke name="Bash">\n'
        f'<{D}parameter name="command" string="true">ls</{D}parameter>\n</{D}invoke>\n</{D}function_calls>{EOS}'
        "\n\n<function_results>\n<result>a.txt</result>\n</function_results>\n\n<｜Assistant｜>"
    )
    assert deepseek_prompt(chat, thinks=True).endswith("</function_results>\n\n</think>")


def test_rendered_calls_parse_back_to_the_same_calls(session: tuple[str, list[Turn], str]) -> None:
    """What the model is shown as its own past calls is what the output parser reads from it."""
    name, turns, last = session
    prompt_format = PromptFormat.for_model(served(DEPLOYMENTS[name]))
    first_reply = last[len(turns[0].prompt) :].split(prompt_format.template.eos_token)[0]
    content = anthropic_reply(prompt_format, turns[0].prompt, first_reply)["content"]
    assert [(block["name"], block["input"]) for block in content if block["type"] == "tool_use"] == [
        ("Read", {"file_path": "/repo/src/app.py"}),
        ("Bash", {"command": 'ls tests/ && grep -rn "hello" tests/', "timeout": 30000}),
    ]
