"""Reasoning in `<think>...</think>`: what a thinking model writes inside goes out as ReasoningDelta.

Only a <think> at the very start of the output opens reasoning (after optional whitespace), so a model
writing about the tag later in its answer is not misread. Qwen3 and DeepSeek templates open <think> in
the prompt themselves: with starts_in_reasoning the output is reasoning until </think>. A stray
</think> in the answer is dropped: a thinking model never means it as text, and it appears when the
prompt opened reasoning without our knowing.

Whitespace right inside the tags and right after </think> is layout, not content, and is dropped.
"""

from __future__ import annotations

from gateway.parsing.events import OutputEvent, ReasoningDelta, TextDelta
from gateway.parsing.markup import partial_tag_length

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"
_WHITESPACE = " \t\r\n"

_START, _REASONING, _TEXT = "start", "reasoning", "text"


class ThinkParser:
    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self._mode = _REASONING if starts_in_reasoning else _START
        self._buffer = ""
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped
        self._held_whitespace = ""  # trailing reasoning whitespace: dropped if </think> follows
        self._after_reasoning = False  # drop the whitespace that follows </think>

    def feed(self, text: str) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        self._buffer += text
        while self._buffer:
            if self._mode == _START:
                stripped = self._buffer.lstrip(_WHITESPACE)
                if len(stripped) < len(OPEN_TAG) and OPEN_TAG.startswith(stripped):
                    break  # whitespace, or the beginning of <think>: undecided yet
                if stripped.startswith(OPEN_TAG):
                    self._buffer = stripped[len(OPEN_TAG) :]
                    self._mode = _REASONING
                else:
                    self._mode = _TEXT
            elif self._mode == _REASONING:
                position = self._buffer.find(CLOSE_TAG)
                if position == -1:
                    keep = len(self._buffer) - partial_tag_length(self._buffer, (CLOSE_TAG,))
                    self._reasoning(self._buffer[:keep], events)
                    self._buffer = self._buffer[keep:]
                    break
                self._reasoning(self._buffer[:position], events)
                self._held_whitespace = ""
                self._buffer = self._buffer[position + len(CLOSE_TAG) :]
                self._mode = _TEXT
                self._after_reasoning = True
            else:
                self._text_until_stray_close(events)
                break
        return events

    def finish(self) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        if self._mode == _REASONING:
            self._reasoning(self._buffer, events)  # cut off while thinking: a held "</thi" is reasoning
        elif self._buffer:
            self._text(self._buffer, events)
        self._buffer = ""
        self._held_whitespace = ""
        return events

    def _text_until_stray_close(self, events: list[OutputEvent]) -> None:
        while True:
            position = self._buffer.find(CLOSE_TAG)
            if position == -1:
                break
            self._text(self._buffer[:position], events)
            self._buffer = self._buffer[position + len(CLOSE_TAG) :]
        keep = len(self._buffer) - partial_tag_length(self._buffer, (CLOSE_TAG,))
        self._text(self._buffer[:keep], events)
        self._buffer = self._buffer[keep:]

    def _reasoning(self, text: str, events: list[OutputEvent]) -> None:
        if not self._reasoning_started:
            text = text.lstrip(_WHITESPACE)
            if not text:
                return
            self._reasoning_started = True
        text = self._held_whitespace + text
        body = text.rstrip(_WHITESPACE)
        self._held_whitespace = text[len(body) :]
        if body:
            events.append(ReasoningDelta(body))

    def _text(self, text: str, events: list[OutputEvent]) -> None:
        if self._after_reasoning:
            text = text.lstrip(_WHITESPACE)
            if not text:
                return
            self._after_reasoning = False
        if text:
            events.append(TextDelta(text))
