"""DeepSeek model outputs (the session's, tests/gateway/data/deepseek/claude_code_session.json, and a few
more) read by the DeepSeek family's output parser into Anthropic messages and OpenAI completions: the
same response whether the text arrives whole, one character at a time, or split in two anywhere."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.api.anthropic.respond import MessageBuilder
from gateway.api.openai.respond import CompletionBuilder
from gateway.parsing.pipeline import make_output_parser
from gateway.ranks.generation import Finish, Usage

SESSION = json.loads((Path(__file__).parent / "data" / "deepseek" / "claude_code_session.json").read_text())
D = "｜DSML｜"

# (name, thinks, the prompt opened <think>, output)
OUTPUTS = [
    *((f"session_turn_{i}_thinking", True, True, turn["output"]) for i, turn in enumerate(SESSION["turns"], 1)),
    *(
        (f"session_turn_{i}_chat", True, False, turn["output"].split("</think>", 1)[1])
        for i, turn in enumerate(SESSION["turns"], 1)
    ),
    ("plain_answer_v3", False, False, "Paris is the capital of France.\n\nIt has been since 987."),
    ("v2_reply_with_its_space", False, False, " Sure. Here is the fix:\n```python\nprint('héllo ✓')\n```"),
    ("reasoning_cut_off", True, True, "Still thinking about the </thi"),
]


def ids() -> Any:
    counter = itertools.count(1)
    return lambda: f"toolu_{next(counter):024d}"


def responses(thinks: bool, opened: bool, chunks: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    parser = make_output_parser("deepseek_dsml", thinks, opened, ids())
    anthropic, openai = MessageBuilder("msg_1", "deepseek"), CompletionBuilder("chatcmpl-1", "deepseek")
    events = [event for chunk in chunks for event in parser.feed(chunk)] + parser.finish()
    reason = "tool_calls" if any(type(event).__name__ == "ToolCallStart" for event in events) else "stop"
    for event in [*events, Finish(reason, Usage(prompt_tokens=10, output_tokens=5))]:
        anthropic.add(event)
        openai.add(event)
    completion = openai.result()
    completion.pop("created")
    return anthropic.result(), completion


@pytest.mark.parametrize(("name", "thinks", "opened", "output"), OUTPUTS, ids=[o[0] for o in OUTPUTS])
def test_any_chunking_gives_the_same_response(name: str, thinks: bool, opened: bool, output: str) -> None:
    whole = responses(thinks, opened, [output])
    assert responses(thinks, opened, list(output)) == whole
    for cut in range(1, len(output)):
        assert responses(thinks, opened, [output[:cut], output[cut:]]) == whole, cut
    for block in whole[0]["content"]:
        if block["type"] == "text":
            assert "<" not in block["text"] and "｜" not in block["text"], block  # no markup leaks into text


def test_thinking_text_and_calls_in_both_shapes() -> None:
    anthropic, openai = responses(True, True, [SESSION["turns"][0]["output"]])
    calls = [
        ("Read", {"file_path": "/repo/src/app.py"}),
        ("Bash", {"command": 'ls tests/ && grep -rn "hello" tests/', "timeout": 30000}),
    ]
    assert anthropic["content"] == [
        {
            "type": "thinking",
            "thinking": (
                "The user wants the greeting fixed. I should read src/app.py first and check the tests directory."
            ),
            "signature": "",
        },
        {"type": "text", "text": "I'll look at the file and the tests first."},
        *(
            {"type": "tool_use", "id": f"toolu_{i:024d}", "name": name, "input": arguments}
            for i, (name, arguments) in enumerate(calls, 1)
        ),
    ]
    assert anthropic["stop_reason"] == "tool_use"
    message = openai["choices"][0]["message"]
    assert message["content"] == "I'll look at the file and the tests first."
    assert message["reasoning_content"].startswith("The user wants the greeting fixed.")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
    assert openai["choices"][0]["finish_reason"] == "tool_calls"


def test_calls_without_text_and_unicode_values() -> None:
    anthropic, _ = responses(True, False, [SESSION["turns"][1]["output"].split("</think>", 1)[1]])
    assert anthropic["content"] == [
        {
            "type": "tool_use",
            "id": "toolu_" + "1".zfill(24),
            "name": "Edit",
            "input": {
                "file_path": "/repo/src/app.py",
                "old_string": 'return f"hello {name}"',
                "new_string": 'return f"héllo ✓ {name}"',
                "replace_all": False,
            },
        }
    ]


def test_plain_answers_and_a_stray_close() -> None:
    anthropic, openai = responses(True, False, ["</think>Paris."])
    assert anthropic["content"] == [{"type": "text", "text": "Paris."}]
    assert openai["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    cut, _ = responses(True, True, ["Still thinking about the </thi"])
    assert cut["content"] == [{"type": "thinking", "thinking": "Still thinking about the </thi", "signature": ""}]
