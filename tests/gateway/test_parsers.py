"""Streaming output parsers on recorded-style model outputs: every chunking gives the same events, and no
piece of markup ever reaches the client as text."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.parsing.call_ids import new_tool_call_id
from gateway.parsing.dsml import DsmlToolParser
from gateway.parsing.events import (
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from gateway.parsing.hermes import HermesToolParser
from gateway.parsing.json_stream import JsonValueStream
from gateway.parsing.pipeline import make_output_parser
from gateway.parsing.think import ThinkParser

D = "｜DSML｜"
HAIKU = "Sure! Here is a haiku:\n\nTokens stream like rain\nthe cache remembers the past\nprefill fades away\n"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Sample:
    """A model output and what the client must get from it (consecutive deltas merged)."""

    family: str
    thinks: bool
    starts_in_reasoning: bool
    output: str
    expected: list[Any] = field(default_factory=list)  # ("text", s), ("reasoning", s) or Call


SAMPLES = {
    "qwen_think_then_answer": Sample(
        "hermes",
        True,
        False,
        "<think>\nThe user asks for the capital of France. That is Paris.\n</think>\n\nThe capital of France is Paris.",
        [
            ("reasoning", "The user asks for the capital of France. That is Paris."),
            ("text", "The capital of France is Paris."),
        ],
    ),
    "qwen_think_then_call": Sample(
        "hermes",
        True,
        False,
        "<think>\nI need to see the files before editing anything.\n</think>\n\nLet me look at the project first.\n\n"
        '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la src/", "description": "List source files"}}\n'
        "</tool_call>",
        [
            ("reasoning", "I need to see the files before editing anything."),
            ("text", "Let me look at the project first."),
            Call("Bash", {"command": "ls -la src/", "description": "List source files"}),
        ],
    ),
    "qwen_two_calls_no_text": Sample(
        "hermes",
        True,
        False,
        '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/repo/src/main.py", "offset": 10, "limit": 200}}\n'
        "</tool_call>\n"
        '<tool_call>\n{"name": "Edit", "arguments": {"file_path": "/repo/src/main.py", "old_string": '
        '"print(\\"hi\\")\\n", "new_string": "print(\\"héllo ✓\\")\\n", "replace_all": false, '
        '"tags": [1, 2.5, null]}}\n'
        "</tool_call>",
        [
            Call("Read", {"file_path": "/repo/src/main.py", "offset": 10, "limit": 200}),
            Call(
                "Edit",
                {
                    "file_path": "/repo/src/main.py",
                    "old_string": 'print("hi")\n',
                    "new_string": 'print("héllo ✓")\n',
                    "replace_all": False,
                    "tags": [1, 2.5, None],
                },
            ),
        ],
    ),
    "qwen3_prompt_opened_think": Sample(
        "hermes",
        True,
        True,
        "Okay, the user wants the tests run. I'll use pytest.\n</think>\n\n"
        '<tool_call>\n{"name": "Bash", "arguments": {"command": "pytest -q tests/", "timeout": 120000}}\n</tool_call>',
        [
            ("reasoning", "Okay, the user wants the tests run. I'll use pytest."),
            Call("Bash", {"command": "pytest -q tests/", "timeout": 120000}),
        ],
    ),
    "smollm2_call_after_text": Sample(
        "hermes",
        False,
        False,
        'I will read the file.\n<tool_call>\n{"name": "Read", "arguments": {"file_path": "README.md"}}\n</tool_call>\n'
        "Then I will summarise it.",
        [
            ("text", "I will read the file."),
            Call("Read", {"file_path": "README.md"}),
            ("text", "Then I will summarise it."),
        ],
    ),
    "smollm2_plain_text": Sample(
        "hermes",
        False,
        False,
        HAIKU,
        [("text", HAIKU)],
    ),
    "deepseek_v32_think_and_calls": Sample(
        "deepseek_dsml",
        True,
        True,
        "The user wants me to check the config and the log level.</think>I'll check both.\n\n"
        f"<{D}function_calls>\n"
        f'<{D}invoke name="Grep">\n'
        f'<{D}parameter name="pattern" string="true">log_level = "(debug|info)"</{D}parameter>\n'
        f'<{D}parameter name="path" string="true">config/\nlocal.yaml</{D}parameter>\n'
        f'<{D}parameter name="head_limit" string="false">20</{D}parameter>\n'
        f'<{D}parameter name="options" string="false">{{"multiline": true, "glob": ["*.yaml"]}}</{D}parameter>\n'
        f"</{D}invoke>\n"
        f'<{D}invoke name="TodoWrite">\n'
        f"</{D}invoke>\n"
        f"</{D}function_calls>",
        [
            ("reasoning", "The user wants me to check the config and the log level."),
            ("text", "I'll check both."),
            Call(
                "Grep",
                {
                    "pattern": 'log_level = "(debug|info)"',
                    "path": "config/\nlocal.yaml",
                    "head_limit": 20,
                    "options": {"multiline": True, "glob": ["*.yaml"]},
                },
            ),
            Call("TodoWrite", {}),
        ],
    ),
    "deepseek_v4_tool_calls_wrapper": Sample(
        "deepseek_dsml",
        False,
        False,
        f"<{D}tool_calls>\n"
        f'<{D}invoke name="Write">\n'
        f'<{D}parameter name="file_path" string="true">/tmp/a.json</{D}parameter>\n'
        f'<{D}parameter name="content" string="true">{{"key": "value with \\"quotes\\""}}\n</{D}parameter>\n'
        f"</{D}invoke>\n"
        f'<{D}invoke name="Bash">\n'
        f'<{D}parameter name="command" string="true">cat /tmp/a.json | jq .</{D}parameter>\n'
        f'<{D}parameter name="run_in_background" string="false">false</{D}parameter>\n'
        f"</{D}invoke>\n"
        f"</{D}tool_calls>\n"
        "Done.",
        [
            Call("Write", {"file_path": "/tmp/a.json", "content": '{"key": "value with \\"quotes\\""}\n'}),
            Call("Bash", {"command": "cat /tmp/a.json | jq .", "run_in_background": False}),
            ("text", "Done."),
        ],
    ),
}

# Markup that must never show up in a text delta (every sample's own text is free of "<" and "｜").
FORBIDDEN_IN_TEXT = ("<", "｜")


def parse(sample: Sample, chunks: list[str]) -> list[OutputEvent]:
    parser = make_output_parser(sample.family, sample.thinks, sample.starts_in_reasoning)
    events: list[OutputEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.finish())
    return events


def summarize(events: list[OutputEvent]) -> list[Any]:
    """Merge consecutive deltas and check the tool call framing; returns the expected-list form."""
    out: list[Any] = []
    open_call: tuple[int, str, list[str]] | None = None
    seen_ids: set[str] = set()
    next_index = 0
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_call is None, "a call started inside another"
            assert event.index == next_index
            assert re.fullmatch(r"toolu_[A-Za-z0-9]{24}", event.id), event.id
            assert event.id not in seen_ids
            seen_ids.add(event.id)
            open_call = (event.index, event.name, [])
        elif isinstance(event, ToolCallArgumentsDelta):
            assert open_call is not None and event.index == open_call[0]
            assert event.fragment
            open_call[2].append(event.fragment)
        elif isinstance(event, ToolCallEnd):
            assert open_call is not None and event.index == open_call[0]
            out.append(Call(open_call[1], json.loads("".join(open_call[2]))))
            open_call, next_index = None, next_index + 1
        else:
            assert open_call is None, "text inside a call"
            assert event.text, "empty delta"
            kind = "text" if isinstance(event, TextDelta) else "reasoning"
            if out and isinstance(out[-1], tuple) and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + event.text)
            else:
                out.append((kind, event.text))
    assert open_call is None, "a call never ended"
    return out


def assert_no_markup_in_text(events: list[OutputEvent]) -> None:
    for event in events:
        if isinstance(event, TextDelta | ReasoningDelta):
            for marker in FORBIDDEN_IN_TEXT:
                assert marker not in event.text, f"markup leaked: {event!r}"


def split_at(text: str, points: list[int]) -> list[str]:
    cuts = sorted({0, len(text), *points})
    return [text[a:b] for a, b in itertools.pairwise(cuts)]


@pytest.mark.parametrize("name", SAMPLES)
def test_whole_output(name: str) -> None:
    sample = SAMPLES[name]
    events = parse(sample, [sample.output])
    assert_no_markup_in_text(events)
    assert summarize(events) == sample.expected


@pytest.mark.parametrize("name", SAMPLES)
def test_char_by_char(name: str) -> None:
    sample = SAMPLES[name]
    events = parse(sample, list(sample.output))
    assert_no_markup_in_text(events)
    assert summarize(events) == sample.expected


@pytest.mark.parametrize("name", SAMPLES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_splits(name: str, data: st.DataObject) -> None:
    sample = SAMPLES[name]
    points = data.draw(st.lists(st.integers(0, len(sample.output)), max_size=40))
    events = parse(sample, split_at(sample.output, points))
    assert_no_markup_in_text(events)
    assert summarize(events) == sample.expected


def test_a_call_starts_as_soon_as_its_name_is_read() -> None:
    parser = HermesToolParser()
    assert parser.feed('<tool_call>\n{"name": "Bas') == []
    events = parser.feed('h", "arguments": {"command": "l')
    assert isinstance(events[0], ToolCallStart) and events[0].name == "Bash"
    assert "".join(e.fragment for e in events[1:] if isinstance(e, ToolCallArgumentsDelta)) == '{"command": "l'
    assert parser.feed("s") == [ToolCallArgumentsDelta(0, "s")]


def test_dsml_call_starts_at_its_invoke_tag() -> None:
    parser = DsmlToolParser()
    assert parser.feed(f"<{D}function_calls>\n<{D}invoke name=") == []
    (start,) = parser.feed('"Read">\n')
    assert isinstance(start, ToolCallStart) and start.name == "Read"
    assert parser.feed(f'<{D}parameter name="file_path" string="true">/a') == [
        ToolCallArgumentsDelta(0, '{"file_path": "/a')
    ]


def run_tools(parser: HermesToolParser | DsmlToolParser, *chunks: str) -> list[Any]:
    events: list[OutputEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return summarize(events + parser.finish())


# Malformed output: what the model wrote is never silently lost, and arguments always parse.


def test_hermes_call_without_json_is_given_back_as_text() -> None:
    assert run_tools(HermesToolParser(), "Hmm <tool_call>I cannot</tool_call> ok") == [
        ("text", "Hmm <tool_call>I cannot</tool_call> ok")
    ]


def test_hermes_stream_cut_before_the_name_is_text() -> None:
    assert run_tools(HermesToolParser(), 'Reading.\n<tool_call>\n{"na') == [("text", 'Reading.\n<tool_call>\n{"na')]


def test_hermes_arguments_cut_mid_string_are_closed() -> None:
    got = run_tools(HermesToolParser(), '<tool_call>\n{"name": "Write", "arguments": {"path": "a.py", "content": "imp')
    assert got == [Call("Write", {"path": "a.py", "content": "imp"})]


def test_hermes_arguments_cut_after_a_key_drop_the_key() -> None:
    got = run_tools(HermesToolParser(), '<tool_call>{"name": "Write", "arguments": {"path": "a.py", "content": ')
    assert got == [Call("Write", {"path": "a.py"})]


def test_hermes_syntax_error_keeps_what_came_before() -> None:
    got = run_tools(HermesToolParser(), '<tool_call>{"name": "X", "arguments": {"a": 1 "b": 2}}</tool_call>After.')
    assert got == [Call("X", {"a": 1}), ("text", "After.")]


def test_hermes_missing_closing_brace_and_newlines_in_strings() -> None:
    got = run_tools(HermesToolParser(), '<tool_call>\n{"name": "X", "arguments": {"code": "a\nb"}\n</tool_call>')
    assert got == [Call("X", {"code": "a\nb"})]


def test_hermes_arguments_before_name_and_as_a_string() -> None:
    got = run_tools(
        HermesToolParser(),
        '<tool_call>{"arguments": {"q": [1]}, "name": "A"}</tool_call>',
        '<tool_call>{"name": "B", "arguments": "{\\"q\\": 2}"}</tool_call>',
        '<tool_call>{"name": "C"}</tool_call>',
    )
    assert got == [Call("A", {"q": [1]}), Call("B", {"q": 2}), Call("C", {})]


def test_hermes_unclosed_call_before_the_next_one() -> None:
    got = run_tools(
        HermesToolParser(), '<tool_call>{"name": "A", "arguments": {}}\n', '<tool_call>{"name": "B"}</tool_call>'
    )
    assert got == [Call("A", {}), Call("B", {})]


def test_hermes_closing_tag_inside_an_argument_string_is_content() -> None:
    got = run_tools(HermesToolParser(), '<tool_call>{"name": "W", "arguments": {"s": "</tool_call>"}}</tool_call>')
    assert got == [Call("W", {"s": "</tool_call>"})]


def test_hermes_text_that_only_looks_like_a_tag_is_flushed_at_the_end() -> None:
    assert run_tools(HermesToolParser(), "if a <b and c <tool") == [("text", "if a <b and c <tool")]


def test_dsml_value_that_is_not_json_becomes_a_string() -> None:
    got = run_tools(
        DsmlToolParser(),
        f'<{D}function_calls><{D}invoke name="X"><{D}parameter name="n" string="false">twelve</{D}parameter>'
        f"</{D}invoke></{D}function_calls>",
    )
    assert got == [Call("X", {"n": "twelve"})]


def test_dsml_cut_inside_a_parameter_closes_the_call() -> None:
    got = run_tools(
        DsmlToolParser(), f'<{D}tool_calls>\n<{D}invoke name="X">\n', f'<{D}parameter name="a" string="true">ab</{D}par'
    )
    assert got == [Call("X", {"a": "ab"})]


def test_dsml_block_without_invoke_is_given_back_as_text() -> None:
    assert run_tools(DsmlToolParser(), f"Well <{D}function_calls>\nno calls here") == [
        ("text", f"Well <{D}function_calls>\nno calls here")
    ]


def test_dsml_stray_text_inside_a_block_ends_it() -> None:
    got = run_tools(
        DsmlToolParser(),
        f'<{D}function_calls>\n<{D}invoke name="X">\n<{D}parameter name="a" string="true">1</{D}parameter>\n'
        f"oops</{D}invoke>",
    )
    assert got == [Call("X", {"a": "1"}), ("text", f"oops</{D}invoke>")]


# Reasoning.


def run_think(parser: ThinkParser, *chunks: str) -> list[Any]:
    events: list[OutputEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return summarize(events + parser.finish())


def test_think_only_at_the_start_opens_reasoning() -> None:
    assert run_think(ThinkParser(), "Use <think> tags like so.") == [("text", "Use <think> tags like so.")]


def test_stray_closing_think_is_dropped() -> None:
    assert run_think(ThinkParser(), "planning...</think>\n\nAnswer.") == [("text", "planning...\n\nAnswer.")]


def test_reasoning_cut_off_stays_reasoning() -> None:
    assert run_think(ThinkParser(starts_in_reasoning=True), "still thinking </thi") == [
        ("reasoning", "still thinking </thi")
    ]


def test_undecided_start_is_flushed_as_text() -> None:
    assert run_think(ThinkParser(), "  <thi") == [("text", "  <thi")]


def test_model_that_does_not_think_keeps_think_tags_as_text() -> None:
    parser = make_output_parser("hermes", thinks=False)
    assert summarize(parser.feed("<think>x</think>") + parser.finish()) == [("text", "<think>x</think>")]


def test_tool_markup_inside_reasoning_is_not_a_call() -> None:
    parser = make_output_parser("hermes", thinks=True)
    events = parser.feed('<think>I could write <tool_call>{"name": "X"}</tool_call> next.</think>Done.')
    assert summarize(events + parser.finish()) == [
        ("reasoning", 'I could write <tool_call>{"name": "X"}</tool_call> next.'),
        ("text", "Done."),
    ]


def test_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown model family"):
        make_output_parser("llama3_json", thinks=False)


def test_tool_call_ids_look_like_anthropic_ones() -> None:
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"toolu_[A-Za-z0-9]{24}", i) for i in ids)


# The JSON streamer behind the arguments.

JSON_DOC = '{"a": 1, "b": [1, -2.5e3, {"c": "x\\ny\\u00e9\\"q"}, [], {}], "d": true, "e": null, "f": "z"}'


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, len(JSON_DOC)))
def test_every_prefix_of_arguments_completes_to_valid_json(cut: int) -> None:
    stream = JsonValueStream(object_only=True)
    stream.push_text(JSON_DOC[:cut])
    released = stream.take()
    completed = json.loads(released + stream.complete())
    assert isinstance(completed, dict)
    assert JSON_DOC.startswith(released.rstrip())  # only ever the model's own text, in order


def test_whole_arguments_come_out_unchanged() -> None:
    stream = JsonValueStream(object_only=True)
    assert stream.push_text(JSON_DOC + "trailing") == len(JSON_DOC)
    assert stream.done and stream.take() == JSON_DOC and stream.complete() == ""


def test_dsml_tag_that_never_closes_is_not_waited_for_forever() -> None:
    parser = DsmlToolParser()
    events = parser.feed(f'<{D}function_calls>\n<{D}invoke name="X" ' + "x" * 2000)
    events += parser.feed(" the end")
    text = "".join(e.text for e in events + parser.finish() if isinstance(e, TextDelta))
    assert text.endswith("x the end") and text.startswith(f"<{D}function_calls>")


# Any mix of markup pieces, well formed or not: no exception, every call's arguments parse (summarize
# checks it), and the chunking never changes the outcome.

FUZZ_PIECES = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "\n", " ", "{", "}", "[", "]", '"', ":", ",", "\\",
    "\\u00e9", "\\n", '"name"', '"arguments"', '"Bash"', '"x"', "1", "-", ".", "e", "true", "nul", "abc", "<",
    "<tool", "</", f"<{D}function_calls>", f"</{D}function_calls>", f"<{D}tool_calls>", f'<{D}invoke name="A">',
    f"</{D}invoke>", f'<{D}parameter name="p" string="true">', f'<{D}parameter name="q" string="false">',
    f"</{D}parameter>", "<｜DS", "｜",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(FUZZ_PIECES), max_size=40),
    points=st.lists(st.integers(0, 400), max_size=20),
    family=st.sampled_from(["hermes", "deepseek_dsml"]),
    thinks=st.booleans(),
    starts_in_reasoning=st.booleans(),
)
def test_garbage_in_any_chunking(
    pieces: list[str], points: list[int], family: str, thinks: bool, starts_in_reasoning: bool
) -> None:
    text = "".join(pieces)
    sample = Sample(family, thinks, starts_in_reasoning, text)
    whole = summarize(parse(sample, [text]))
    assert summarize(parse(sample, list(text))) == whole
    assert summarize(parse(sample, split_at(text, points))) == whole


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.characters(blacklist_characters="<｜"), max_size=60),
    points=st.lists(st.integers(0, 60), max_size=10),
    family=st.sampled_from(["hermes", "deepseek_dsml"]),
)
def test_plain_text_passes_through_unchanged(text: str, points: list[int], family: str) -> None:
    events = parse(Sample(family, False, False, text), split_at(text, points))
    assert all(isinstance(e, TextDelta) for e in events)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text
