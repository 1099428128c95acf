"""One parser per response: reasoning first (<think>), then tool calls in the model family's markup."""

from __future__ import annotations

from typing import Protocol

from contracts.model_types import DEEPSEEK_DSML, HERMES, PROMPT_FAMILIES
from gateway.parsing.call_ids import ToolCallIdFactory, new_tool_call_id
from gateway.parsing.dsml import DsmlToolParser
from gateway.parsing.events import OutputEvent, TextDelta
from gateway.parsing.hermes import HermesToolParser
from gateway.parsing.think import ThinkParser


class StreamParser(Protocol):
    def feed(self, text: str) -> list[OutputEvent]: ...

    def finish(self) -> list[OutputEvent]: ...


class OutputParser:
    """Model text in, OutputEvents out: feed() each piece as it streams, finish() once at the end."""

    def __init__(self, tool_parser: StreamParser, think_parser: ThinkParser | None = None) -> None:
        self._think = think_parser
        self._tools = tool_parser

    def feed(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        if self._think is None:
            return self._tools.feed(text)
        return self._through_tools(self._think.feed(text))

    def finish(self) -> list[OutputEvent]:
        events = self._through_tools(self._think.finish()) if self._think is not None else []
        return events + self._tools.finish()

    def _through_tools(self, events: list[OutputEvent]) -> list[OutputEvent]:
        # Reasoning is passed on as is: tool markup inside the thinking is thought, not a call.
        out: list[OutputEvent] = []
        for event in events:
            out.extend(self._tools.feed(event.text) if isinstance(event, TextDelta) else [event])
        return out


def make_output_parser(
    family: str, thinks: bool, starts_in_reasoning: bool = False, new_id: ToolCallIdFactory = new_tool_call_id
) -> OutputParser:
    """The parser for one response of a model of `family` ("hermes" or "deepseek_dsml").

    thinks: the model may open its output with <think>; starts_in_reasoning: the prompt already opened it
    (see gateway.prompt.render.prompt_opens_reasoning)."""
    if family == DEEPSEEK_DSML:
        tools: StreamParser = DsmlToolParser(new_id)
    elif family == HERMES:
        tools = HermesToolParser(new_id)
    else:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(PROMPT_FAMILIES)}")
    think = ThinkParser(starts_in_reasoning=starts_in_reasoning) if thinks or starts_in_reasoning else None
    return OutputParser(tools, think)
