"""DeepSeek DSML tool calls (V3.2: `function_calls` wrapper; V4: `tool_calls`, same invoke/parameter grammar).

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="K" string="true">raw text value</｜DSML｜parameter>
    <｜DSML｜parameter name="N" string="false">JSON value</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Each invoke becomes a call as soon as its tag is read; its parameters stream as fragments of one JSON
object: a string="true" value is JSON-escaped as it arrives, a string="false" value is read whole and
checked (JSON that does not parse is sent as a string rather than break the object).

Malformed markup, the choice made here: unexpected text inside a calls block ends the block; an open
call is closed with the parameters read so far, and the rest is read as text again. A block in which no
invoke started is given back as text, markup included, so that nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re

from gateway.parsing.call_ids import ToolCallIdFactory, new_tool_call_id
from gateway.parsing.events import OutputEvent, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from gateway.parsing.markup import WHITESPACE, TextAroundCalls, first_tag, partial_tag_length

DSML = "｜DSML｜"
BLOCK_OPEN_TAGS = (f"<{DSML}function_calls>", f"<{DSML}tool_calls>")
BLOCK_CLOSE_TAGS = (f"</{DSML}function_calls>", f"</{DSML}tool_calls>")
INVOKE_START = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_START = f"<{DSML}parameter"
PARAMETER_CLOSE = f"</{DSML}parameter>"
_ATTRIBUTE = re.compile(r'([A-Za-z_]+)\s*=\s*"([^"]*)"')
_LONGEST_TAG = 1024  # an opening tag longer than this is not one: give up waiting for its ">"

_TEXT, _BLOCK, _INVOKE, _STRING_VALUE, _JSON_VALUE = "text", "block", "invoke", "string_value", "json_value"


class DsmlToolParser:
    def __init__(self, new_id: ToolCallIdFactory = new_tool_call_id) -> None:
        self._new_id = new_id
        self._buffer = ""
        self._mode = _TEXT
        self._text = TextAroundCalls()
        self._calls_started = 0
        self._block_raw = ""  # the block so far, while no invoke in it has started
        self._block_has_calls = False
        self._parameters = 0  # parameters sent for the open call
        self._json_value = ""  # a string="false" value being read
        self._unsent = ""  # argument text for the open call, sent once per feed

    def feed(self, text: str) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        self._buffer += text
        while self._buffer and self._step(events):
            pass
        self._send_arguments(events)
        return events

    def finish(self) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        if self._mode == _TEXT:
            self._text.text(self._buffer, events)  # a held "<｜DS" that never became a tag is text
        elif self._mode == _BLOCK and not self._block_has_calls:
            self._text.text(self._block_raw + self._buffer, events)
        elif self._mode != _BLOCK:
            self._close_call(events)  # cut off inside a call: a held partial closing tag is dropped
        self._buffer = ""
        self._text.finish(events, calls_made=self._calls_started > 0)
        return events

    def _step(self, events: list[OutputEvent]) -> bool:
        """Make progress on the buffer; False when it needs more text."""
        if self._mode == _TEXT:
            return self._text_step(events)
        if self._mode in (_STRING_VALUE, _JSON_VALUE):
            return self._value_step(events)
        stripped = self._buffer.lstrip(WHITESPACE)
        if not self._block_has_calls:
            self._block_raw += self._buffer[: len(self._buffer) - len(stripped)]
        self._buffer = stripped
        if not stripped:
            return False
        if self._mode == _BLOCK:
            return self._block_step(events)
        return self._invoke_step(events)

    def _text_step(self, events: list[OutputEvent]) -> bool:
        position, tag = first_tag(self._buffer, BLOCK_OPEN_TAGS)
        if position == -1:
            keep = len(self._buffer) - partial_tag_length(self._buffer, BLOCK_OPEN_TAGS)
            self._text.text(self._buffer[:keep], events)
            self._buffer = self._buffer[keep:]
            return False
        self._text.text(self._buffer[:position], events)
        self._buffer = self._buffer[position + len(tag) :]
        self._block_raw = self._text.take_held() + tag
        self._block_has_calls = False
        self._mode = _BLOCK
        return True

    def _block_step(self, events: list[OutputEvent]) -> bool:
        for tag in BLOCK_CLOSE_TAGS:
            if self._buffer.startswith(tag):
                self._buffer = self._buffer[len(tag) :]
                self._end_block(events)
                return True
        if self._buffer.startswith(INVOKE_START):
            attributes = self._opening_tag()
            if attributes is None:
                return self._still_a_tag(events)
            name = attributes.get("name", "")
            if not name:
                return self._malformed(events)
            self._block_has_calls = True
            events.append(ToolCallStart(self._calls_started, self._new_id(), name))
            self._parameters = 0
            self._mode = _INVOKE
            return True
        if _could_become(self._buffer, (INVOKE_START, *BLOCK_CLOSE_TAGS)):
            return False
        return self._malformed(events)

    def _invoke_step(self, events: list[OutputEvent]) -> bool:
        if self._buffer.startswith(INVOKE_CLOSE):
            self._buffer = self._buffer[len(INVOKE_CLOSE) :]
            self._close_call(events)
            self._mode = _BLOCK
            return True
        if self._buffer.startswith(PARAMETER_START):
            attributes = self._opening_tag()
            if attributes is None:
                return self._still_a_tag(events)
            self._unsent += ("{" if self._parameters == 0 else ", ") + _json(attributes.get("name", "")) + ": "
            self._parameters += 1
            if attributes.get("string") == "true":
                self._unsent += '"'
                self._mode = _STRING_VALUE
            else:
                self._json_value = ""
                self._mode = _JSON_VALUE  # string="false", or no attribute: JSON if it parses
            return True
        if _could_become(self._buffer, (INVOKE_CLOSE, PARAMETER_START)):
            return False
        return self._malformed(events)

    def _value_step(self, events: list[OutputEvent]) -> bool:
        position = self._buffer.find(PARAMETER_CLOSE)
        end = position if position != -1 else len(self._buffer) - partial_tag_length(self._buffer, (PARAMETER_CLOSE,))
        value, self._buffer = self._buffer[:end], self._buffer[end:]
        if self._mode == _STRING_VALUE:
            self._unsent += _json(value)[1:-1]
        else:
            self._json_value += value
        if position == -1:
            return False
        self._buffer = self._buffer[len(PARAMETER_CLOSE) :]
        self._end_value()
        self._mode = _INVOKE
        return True

    def _opening_tag(self) -> dict[str, str] | None:
        """The attributes of the tag at the start of the buffer, consumed; None while its ">" has not arrived."""
        end = self._buffer.find(">")
        if end == -1:
            return None
        tag, self._buffer = self._buffer[: end + 1], self._buffer[end + 1 :]
        return dict(_ATTRIBUTE.findall(tag))

    def _still_a_tag(self, events: list[OutputEvent]) -> bool:
        """Wait for the rest of an opening tag, unless it has grown too long to be one."""
        return self._malformed(events) if len(self._buffer) > _LONGEST_TAG else False

    def _end_value(self) -> None:
        if self._mode == _STRING_VALUE:
            self._unsent += '"'
            return
        try:
            self._unsent += _json(json.loads(self._json_value))
        except ValueError:
            self._unsent += _json(self._json_value)  # not JSON after all: keep it, as a string
        self._json_value = ""

    def _close_call(self, events: list[OutputEvent]) -> None:
        if self._mode in (_STRING_VALUE, _JSON_VALUE):
            self._end_value()
        self._unsent += "}" if self._parameters else "{}"
        self._send_arguments(events)
        events.append(ToolCallEnd(self._calls_started))
        self._calls_started += 1
        self._mode = _BLOCK

    def _end_block(self, events: list[OutputEvent]) -> None:
        if self._block_has_calls:
            self._text.call_ended()
        else:
            self._text.text(self._block_raw, events)  # an empty block: odd, but it is what the model wrote
        self._block_raw = ""
        self._mode = _TEXT

    def _malformed(self, events: list[OutputEvent]) -> bool:
        """Unexpected text inside a block: close what is open and read the rest as text again."""
        if self._mode not in (_TEXT, _BLOCK):
            self._close_call(events)
        if self._block_has_calls:
            self._text.call_ended()
        else:
            self._text.text(self._block_raw, events)  # given back as text, markup included
        self._block_raw = ""
        self._block_has_calls = False
        self._mode = _TEXT
        return True

    def _send_arguments(self, events: list[OutputEvent]) -> None:
        if self._unsent:
            events.append(ToolCallArgumentsDelta(self._calls_started, self._unsent))
            self._unsent = ""


def _could_become(text: str, tags: tuple[str, ...]) -> bool:
    """`text` is the start of one of `tags` (more text may complete it)."""
    return any(tag.startswith(text) for tag in tags)


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)
