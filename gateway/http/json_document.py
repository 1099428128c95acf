"""A request body parsed into a JSON document that the rest of the gateway can handle: nested no deeper
than MAX_DEPTH (templates, tool-argument JSON and validation recurse) and with no lone UTF-16 surrogate in
any string or key (`"\\ud800"` is valid JSON but cannot be encoded to UTF-8: not by the tokenizer, not in
an answer).

Parsing is written to run in a worker thread without starving the event loop: a Python-level hook for every
object and number lets the interpreter hand the GIL back to the loop while a large body is parsed (the C
decoder alone would hold it for seconds)."""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.http.errors import InvalidDocument

MAX_DEPTH = 128  # real requests (tool schemas included) nest a few dozen levels at most
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# A \uXXXX escape of a surrogate with the run of backslashes before its "u" (an even run is plain text)
_SURROGATE_ESCAPE = re.compile(rb"(\\+)u([dD][89a-fA-F][0-9a-fA-F]{2})")
_SURROGATE_ESCAPE_TEXT = re.compile(r"(\\+)u([dD][89a-fA-F][0-9a-fA-F]{2})")


def parse_document(raw: bytes | bytearray | str, what: str = "request body") -> Any:
    """The parsed body (or JSON text inside it, such as OpenAI tool-call arguments); raises InvalidDocument
    for invalid JSON, nesting past MAX_DEPTH or a lone surrogate."""
    if lone_surrogate_in(raw):
        raise InvalidDocument(f"{what}: a string holds a lone UTF-16 surrogate (U+D800-U+DFFF), not valid Unicode")
    try:
        document = json.loads(raw, object_pairs_hook=_object, parse_int=_int, parse_float=_float)
    except RecursionError as exc:
        raise InvalidDocument(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidDocument(f"{what} is not valid JSON: {exc}") from exc
    if nesting_depth(document, stop_past=MAX_DEPTH) > MAX_DEPTH:
        raise InvalidDocument(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)")
    return document


def lone_surrogate_in(raw: bytes | bytearray | str) -> bool:
    """Whether the JSON text, once decoded, would hold a UTF-16 surrogate that is not half of a pair.

    Read from the text's escapes (UTF-8 cannot carry a surrogate otherwise) rather than from every decoded
    string: one regular-expression scan, almost always with nothing to look at; an escaped pair, as
    ensure_ascii writes an emoji, is fine."""
    if isinstance(raw, str):
        if _LONE_SURROGATE.search(raw):
            return True  # a str may hold one as it is
        if "\\ud" not in raw and "\\uD" not in raw:
            return False
        escapes = _SURROGATE_ESCAPE_TEXT.finditer(raw)
    else:
        if b"\\ud" not in raw and b"\\uD" not in raw:
            return False  # a substring search runs at memory speed; the expression below does not
        escapes = _SURROGATE_ESCAPE.finditer(raw)
    high_ended_at = -1  # where the escape of a high surrogate still waiting for its low half ends
    for match in escapes:
        if len(match.group(1)) % 2 == 0:
            continue  # the backslash is itself escaped: the text says "\ud800", no surrogate
        starts_at = match.end(1) - 1
        if int(match.group(2), 16) < 0xDC00:  # a high surrogate: its low half must follow at once
            if high_ended_at >= 0:
                return True
            high_ended_at = match.end()
        elif high_ended_at == starts_at:
            high_ended_at = -1
        else:
            return True  # a low surrogate with no high one just before it
    return high_ended_at >= 0


def nesting_depth(document: Any, stop_past: int) -> int:
    """How deep containers nest (1 for a flat object or array), counted level by level without recursion
    (the document may be deeper than the stack); counting stops once past `stop_past`."""
    level = [document] if isinstance(document, (dict, list)) else []
    depth = 0
    while level and depth <= stop_past:
        depth += 1
        below: list[Any] = []
        for container in level:
            items = container.values() if isinstance(container, dict) else container
            below += [item for item in items if isinstance(item, (dict, list))]
        level = below
    return depth


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)
