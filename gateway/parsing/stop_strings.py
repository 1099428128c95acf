"""Stop sequences on streamed text: cut at the first one to appear, never showing part of one.

Text that could be the start of a stop sequence is held back until the next piece decides it. Among
overlapping candidates the first one to be complete wins (then the one that starts first), which is
the answer whatever the chunking, so a stream and the same text in one piece stop at the same place.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = sorted({stop for stop in stops if stop})
        self._buffer = ""
        self.matched: str | None = None  # the stop sequence that ended the text, once one has

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to show, the stop sequence just matched or None); after a match, everything is dropped."""
        if self.matched is not None:
            return "", None
        self._buffer += text
        match = self._first_complete()
        if match is not None:
            position, stop = match
            safe, self._buffer, self.matched = self._buffer[:position], "", stop
            return safe, stop
        keep = self._held_length()
        safe, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
        return safe, None

    def finish(self) -> str:
        """The held text once the stream has ended: it never became a stop sequence."""
        held, self._buffer = self._buffer, ""
        return held if self.matched is None else ""

    def _first_complete(self) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            position = self._buffer.find(stop)
            if position != -1:
                candidate = (position + len(stop), position, stop)
                if best is None or candidate < best:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _held_length(self) -> int:
        """The longest suffix of the buffer that is a proper prefix of some stop sequence."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._buffer)), longest, -1):
                if self._buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
