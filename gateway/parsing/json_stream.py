"""Stream a JSON value that a model is still writing, releasing only text that can still end as valid JSON.

Tool call arguments go to clients as fragments that must concatenate to a valid JSON object, yet a model
can stop mid-value (max_tokens) or write broken JSON. This scanner validates character by character and
releases text only up to a point from which `complete()` can always close the value: a key is held back
until its value starts, a comma until the next member starts, a number or literal until it ends, an
escape sequence until it is whole. Whatever happens later, released text + complete() parses.
"""

from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_HEX = frozenset("0123456789abcdefABCDEF")
_WHITESPACE = frozenset(" \t\r\n")

# States: what the next significant character may be.
_START = "start"  # the value itself, not begun
_VALUE = "value"  # a value (after ":" or "," in an array)
_VALUE_OR_CLOSE = "value_or_close"  # right after "["
_KEY = "key"  # a key (after "," in an object)
_KEY_OR_CLOSE = "key_or_close"  # right after "{"
_COLON = "colon"
_AFTER_VALUE = "after_value"  # "," or a closing bracket
_STRING = "string"  # inside a string value
_KEY_STRING = "key_string"  # inside an object key
_NUMBER_TOKEN = "number"
_LITERAL_TOKEN = "literal"


class JsonValueStream:
    def __init__(self, *, object_only: bool = False) -> None:
        self._object_only = object_only  # tool arguments: anything but an object is a syntax error
        self._state = _START
        self._stack: list[str] = []  # open containers, "{" or "["
        self._pending = ""  # accepted text that is not safe to release yet
        self._token = ""  # the number or literal being read
        self._escape = ""  # the escape sequence being read inside a string
        self._released: list[str] = []
        self._first = ""
        self.started = False  # the first significant character arrived
        self.done = False  # the value is complete; push() accepts nothing more
        self.failed = False  # a syntax error: push() accepts nothing more

    @property
    def first_char(self) -> str:
        """What kind of value this is ("{", "[", '"', a digit, ...), once started."""
        return self._first

    def take(self) -> str:
        """The text released since the last take()."""
        text = "".join(self._released)
        self._released.clear()
        return text

    def push_text(self, text: str) -> int:
        """Push characters until the value ends or fails; returns how many were consumed."""
        for count, char in enumerate(text):
            if not self.push(char):
                return count
        return len(text)

    def push(self, char: str) -> bool:
        """Consume one character; False when it is not part of the value (then see done / failed)."""
        if self.done or self.failed:
            return False
        state = self._state
        if state in (_STRING, _KEY_STRING):
            return self._string_char(char)
        if state == _LITERAL_TOKEN:
            return self._literal_char(char)
        if state == _NUMBER_TOKEN:
            if char in _NUMBER_CHARS:
                self._token += char
                return True
            if not self._end_number():
                return self._fail()
            if self.done:
                return False  # a top-level number ends at the first character after it
            state = self._state
        if char in _WHITESPACE:
            if state != _START:
                self._pending += char
            return True
        if state in (_START, _VALUE, _VALUE_OR_CLOSE):
            if state == _START:
                if self._object_only and char != "{":
                    return self._fail()
                self.started, self._first = True, char
            if char == "]" and state == _VALUE_OR_CLOSE:
                return self._close(char)
            if char == "]" and state == _VALUE and self._stack[-1:] == ["["]:
                return self._close(char, drop_pending=True)  # a trailing comma: forgiven
            return self._begin_value(char)
        if state in (_KEY, _KEY_OR_CLOSE):
            if char == "}":
                return self._close(char, drop_pending=state == _KEY)  # _KEY: after a trailing comma
            if char != '"':
                return self._fail()
            self._pending += char
            self._state = _KEY_STRING
            return True
        if state == _COLON:
            if char != ":":
                return self._fail()
            self._pending += char
            self._state = _VALUE
            return True
        # _AFTER_VALUE
        if char == "," and self._stack:
            self._pending += char
            self._state = _KEY if self._stack[-1] == "{" else _VALUE
            return True
        if char in "}]" and self._stack and _closer(self._stack[-1]) == char:
            return self._close(char)
        return self._fail()

    def complete(self) -> str:
        """Text that, appended to everything released, makes a valid JSON value; ends the stream."""
        if self.done:
            return ""
        if self._state == _NUMBER_TOKEN and self._end_number() and self.done:
            return self.take()  # a top-level number, ended by the end of the text
        tail = self.take()
        if self._state == _STRING:
            tail += '"'  # an unfinished escape sequence was never released
        if not self.started or (self._state == _NUMBER_TOKEN and not self._stack):
            tail += "{}" if self._object_only else "null"
        for bracket in reversed(self._stack):
            tail += _closer(bracket)
        self._pending = ""  # a dangling key, comma or broken literal is dropped
        self._stack.clear()
        self.done = True
        return tail

    def _begin_value(self, char: str) -> bool:
        if char in "{[":
            self._release(char)
            self._stack.append(char)
            self._state = _KEY_OR_CLOSE if char == "{" else _VALUE_OR_CLOSE
        elif char == '"':
            self._release(char)
            self._state = _STRING
        elif char == "-" or char.isdigit():
            self._token = char
            self._state = _NUMBER_TOKEN
        elif char in _LITERALS:
            self._token = char
            self._state = _LITERAL_TOKEN
        else:
            return self._fail()
        return True

    def _string_char(self, char: str) -> bool:
        if self._escape:
            self._escape += char
            if len(self._escape) == 2 and char not in '"\\/bfnrtu':
                return self._fail()
            if len(self._escape) > 2 and char not in _HEX:
                return self._fail()
            if (len(self._escape) == 2 and char != "u") or len(self._escape) == 6:
                self._string_text(self._escape)
                self._escape = ""
            return True
        if char == "\\":
            self._escape = char
        elif char == '"':
            if self._state == _KEY_STRING:
                self._pending += char
                self._state = _COLON
            else:
                self._release(char)
                self._value_ended()
        else:
            # A raw newline or tab inside a string is invalid JSON that models do write: escape it.
            self._string_text(json.dumps(char)[1:-1] if ord(char) < 0x20 else char)
        return True

    def _string_text(self, text: str) -> None:
        if self._state == _KEY_STRING:
            self._pending += text
        else:
            self._release(text)

    def _literal_char(self, char: str) -> bool:
        target = _LITERALS[self._token[0]]
        if not target.startswith(self._token + char):
            return self._fail()
        self._token += char
        if self._token == target:
            self._release(self._token)
            self._token = ""
            self._value_ended()
        return True

    def _end_number(self) -> bool:
        if not _NUMBER.fullmatch(self._token):
            return False
        self._release(self._token)
        self._token = ""
        self._value_ended()
        return True

    def _value_ended(self) -> None:
        self._state = _AFTER_VALUE
        if not self._stack:
            self.done = True

    def _close(self, char: str, *, drop_pending: bool = False) -> bool:
        if drop_pending:
            self._pending = ""
        self._release(char)
        self._stack.pop()
        self._value_ended()
        return True

    def _release(self, text: str) -> None:
        self._released.append(self._pending + text)
        self._pending = ""

    def _fail(self) -> bool:
        self.failed = True
        return False


def _closer(bracket: str) -> str:
    return "}" if bracket == "{" else "]"
