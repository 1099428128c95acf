"""Helpers shared by the streaming parsers: holding back a tag that has only partly arrived, text around calls."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.parsing.events import OutputEvent, TextDelta

WHITESPACE = " \t\r\n"


def partial_tag_length(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (0 if none).

    That suffix may still become a tag with the next chunk, so a parser must not emit it yet."""
    longest = max((len(tag) for tag in tags), default=0)
    start = max(0, len(text) - longest + 1)
    # Every tag starts with "<": only suffixes that start at a "<" can be a tag's beginning.
    position = text.find("<", start)
    while position != -1:
        suffix = text[position:]
        if any(tag.startswith(suffix) and tag != suffix for tag in tags):
            return len(text) - position
        position = text.find("<", position + 1)
    return 0


def first_tag(text: str, tags: Sequence[str]) -> tuple[int, str]:
    """(position, tag) of the earliest tag in `text`, or (-1, "")."""
    best, found = -1, ""
    for tag in tags:
        position = text.find(tag)
        if position != -1 and (best == -1 or position < best):
            best, found = position, tag
    return best, found


class TextAroundCalls:
    """Text outside tool calls, minus the whitespace that only separates it from the calls.

    Trailing whitespace is held until more text shows it belongs to the text; the whitespace just after a
    call is dropped. Clients then get no text blocks of bare newlines between tool calls."""

    def __init__(self) -> None:
        self._held_whitespace = ""
        self._after_call = False

    def text(self, text: str, events: list[OutputEvent]) -> None:
        if self._after_call:
            text = text.lstrip(WHITESPACE)
            if not text:
                return
            self._after_call = False
        text = self._held_whitespace + text
        body = text.rstrip(WHITESPACE)
        self._held_whitespace = text[len(body) :]
        if body:
            events.append(TextDelta(body))

    def take_held(self) -> str:
        """The held whitespace, for a call to give back if it turns out to be text after all."""
        held, self._held_whitespace = self._held_whitespace, ""
        return held

    def call_ended(self) -> None:
        self._after_call = True

    def finish(self, events: list[OutputEvent], *, calls_made: bool) -> None:
        # Trailing whitespace of a plain answer is kept; after tool calls it is only layout.
        if self._held_whitespace and not calls_made:
            events.append(TextDelta(self._held_whitespace))
        self._held_whitespace = ""
