"""Hermes-style tool calls (Qwen, SmolLM2, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

A call starts (ToolCallStart) as soon as its name has been read; its arguments then stream as fragments
of the JSON object (see json_stream), and it ends at </tool_call>. Text between calls is text; the
whitespace just around a call is dropped so clients do not get text blocks of "\\n\\n".

Malformed calls, the choice made here: a call whose name was read is always delivered, its arguments
closed into valid JSON from the last well-formed point (whatever follows the call's JSON, or a syntax
error in it, up to </tool_call> is dropped). A call whose name never appeared (garbage, or the stream ended first) is
given back as plain text, markup included, so that nothing the model wrote is lost.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.parsing.call_ids import ToolCallIdFactory, new_tool_call_id
from gateway.parsing.events import OutputEvent, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from gateway.parsing.json_stream import JsonValueStream
from gateway.parsing.markup import WHITESPACE, TextAroundCalls, first_tag, partial_tag_length

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")  # some models write "parameters"

_TEXT, _CALL, _SEEK = "text", "call", "seek"  # parser modes; _SEEK: the JSON is over, find </tool_call>


class HermesToolParser:
    def __init__(self, new_id: ToolCallIdFactory = new_tool_call_id) -> None:
        self._new_id = new_id
        self._buffer = ""
        self._mode = _TEXT
        self._call: _Call | None = None
        self._calls_started = 0
        self._text = TextAroundCalls()

    def feed(self, text: str) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        self._buffer += text
        while self._buffer:
            if self._mode == _TEXT:
                position = self._buffer.find(OPEN_TAG)
                if position == -1:
                    keep = len(self._buffer) - partial_tag_length(self._buffer, (OPEN_TAG,))
                    self._text.text(self._buffer[:keep], events)
                    self._buffer = self._buffer[keep:]
                    break
                self._text.text(self._buffer[:position], events)
                self._buffer = self._buffer[position + len(OPEN_TAG) :]
                self._open_call()
            elif self._mode == _CALL:
                assert self._call is not None
                consumed = self._call.feed(self._buffer, events)
                self._buffer = self._buffer[consumed:]
                if self._buffer:
                    self._mode = _SEEK  # the JSON ended or broke: the rest up to </tool_call> is not arguments
            else:
                assert self._call is not None
                position, tag = first_tag(self._buffer, (CLOSE_TAG, OPEN_TAG))
                if position == -1:
                    keep = len(self._buffer) - partial_tag_length(self._buffer, (CLOSE_TAG, OPEN_TAG))
                    self._call.raw += self._buffer[:keep]
                    self._buffer = self._buffer[keep:]
                    break
                # A new <tool_call> before </tool_call>: the model forgot to close the previous one.
                end = position + len(tag) if tag == CLOSE_TAG else position
                self._call.raw += self._buffer[:end]
                self._buffer = self._buffer[position + len(tag) :]
                self._close_call(events)
                if tag == OPEN_TAG:
                    self._open_call()
        return events

    def finish(self) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        if self._mode == _TEXT:
            self._text.text(self._buffer, events)  # a held "<tool_c" that never became a tag is text
        else:
            assert self._call is not None
            self._call.raw += self._buffer
            self._close_call(events)
        self._buffer = ""
        self._text.finish(events, calls_made=self._calls_started > 0)
        return events

    def _open_call(self) -> None:
        # The whitespace before the tag goes with the call: dropped if it is one, given back if not.
        self._call = _Call(self._calls_started, self._new_id, self._text.take_held() + OPEN_TAG)
        self._mode = _CALL

    def _close_call(self, events: list[OutputEvent]) -> None:
        assert self._call is not None
        call, self._call, self._mode = self._call, None, _TEXT
        if call.finish(events):
            self._calls_started += 1
            self._text.call_ended()
        else:
            self._text.text(call.raw, events)


# States of the call object {"name": ..., "arguments": ...}.
_BEFORE, _KEY_OR_CLOSE, _KEY, _IN_KEY, _COLON, _VALUE, _AFTER_VALUE, _DONE = range(8)


class _Call:
    """One <tool_call> body, read character by character."""

    def __init__(self, index: int, new_id: ToolCallIdFactory, raw: str) -> None:
        self.index = index
        self.raw = raw  # everything since the tag, given back as text if this never becomes a call
        self._new_id = new_id
        self._state = _BEFORE
        self._key_stream: JsonValueStream | None = None
        self._key = ""
        self._value: JsonValueStream | None = None
        self._value_text = ""
        self._name: str | None = None
        self._started = False
        self._arguments: JsonValueStream | None = None
        self._unsent = ""  # argument text not sent yet (all of it while the name is unknown)
        self._arguments_json: str | None = None  # arguments given as a JSON string, decoded

    def feed(self, text: str, events: list[OutputEvent]) -> int:
        """Consume characters of the call's JSON; returns how many (fewer than len(text) once the JSON is over)."""
        count = 0
        for char in text:
            if not self._step(char, events):
                break
            count += 1
        if not self._started:
            self.raw += text[:count]
        self._send_fragments(events)
        return count

    def finish(self, events: list[OutputEvent]) -> bool:
        """Close the call (True), or report that it never started and must be given back as text (False)."""
        if not self._started:
            return False
        arguments = self._arguments
        self._send_fragments(events)
        if self._arguments_json is not None:
            tail = self._arguments_json
        elif arguments is not None and arguments.first_char == "{":
            tail = arguments.complete()
        else:
            tail = "{}"  # no arguments, or a value that is not an object
        if tail:
            events.append(ToolCallArgumentsDelta(self.index, tail))
        events.append(ToolCallEnd(self.index))
        return True

    def _step(self, char: str, events: list[OutputEvent]) -> bool:
        state = self._state
        if state == _VALUE:
            return self._value_char(char, events)
        if state == _IN_KEY:
            assert self._key_stream is not None
            if not self._key_stream.push(char):
                return False
            if self._key_stream.done:
                self._key = json.loads(self._key_stream.take())
                self._state = _COLON
            return True
        if state == _DONE:
            return False
        if char in WHITESPACE:
            return True
        if state == _BEFORE:
            if char == "<":
                return False  # markup before any JSON: a closing tag, or garbage
            if char == "{":
                self._state = _KEY_OR_CLOSE
            return True  # anything else before the object (a ```json fence) is skipped
        if state in (_KEY_OR_CLOSE, _KEY):
            if char == "}":
                self._state = _DONE
                return True
            if char != '"':
                return False
            self._key_stream = JsonValueStream()
            self._key_stream.push(char)
            self._state = _IN_KEY
            return True
        if state == _COLON:
            if char != ":":
                return False
            self._begin_value()
            return True
        # _AFTER_VALUE
        if char == ",":
            self._state = _KEY
            return True
        if char == "}":
            self._state = _DONE
            return True
        return False

    def _begin_value(self) -> None:
        self._value = JsonValueStream()
        self._value_text = ""
        if self._key in _ARGUMENT_KEYS and self._arguments is None:
            self._arguments = self._value
        self._state = _VALUE

    def _value_char(self, char: str, events: list[OutputEvent]) -> bool:
        value = self._value
        assert value is not None
        consumed = value.push(char)
        if value is self._arguments and value.first_char == "{":
            self._unsent += value.take()
        else:
            self._value_text += value.take()
        if not value.done:
            return consumed  # not consumed and not done: a syntax error ends the call's JSON
        self._value_done(events)
        self._state = _AFTER_VALUE
        return True if consumed else self._step(char, events)  # a number ends at the character after it

    def _value_done(self, events: list[OutputEvent]) -> None:
        if self._value is self._arguments:
            if self._arguments is not None and self._arguments.first_char != "{":
                self._arguments_json = _decode_string_arguments(self._value_text)
            return
        if self._key == "name" and self._name is None:
            name = json.loads(self._value_text)
            if isinstance(name, str) and name:
                self._name = name
                self._start(events)

    def _send_fragments(self, events: list[OutputEvent]) -> None:
        # One delta per chunk of model text, not one per character.
        if self._started and self._unsent:
            events.append(ToolCallArgumentsDelta(self.index, self._unsent))
            self._unsent = ""

    def _start(self, events: list[OutputEvent]) -> None:
        assert self._name is not None
        self._started = True
        events.append(ToolCallStart(self.index, self._new_id(), self._name))


def _decode_string_arguments(value_text: str) -> str:
    """Arguments written as a JSON string holding the object (or null): the object's JSON, else {}."""
    value: Any = json.loads(value_text)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return "{}"
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else "{}"
