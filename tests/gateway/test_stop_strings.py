"""Stop sequences on a stream: the cut falls where it would on the whole text, and no part of a stop
sequence is ever shown."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.parsing.stop_strings import StopMatcher


def stream(stops: list[str], chunks: list[str]) -> tuple[str, str | None, list[str]]:
    matcher = StopMatcher(stops)
    shown: list[str] = []
    for chunk in chunks:
        safe, matched = matcher.feed(chunk)
        shown.append(safe)
        if matched is not None:
            return "".join(shown), matched, shown
    shown.append(matcher.finish())
    return "".join(shown), None, shown


def reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """The first stop sequence to be complete when reading left to right (then the one starting first)."""
    for end in range(len(text) + 1):
        for start in range(end + 1):
            if text[start:end] in stops and text[start:end]:
                return text[:start], text[start:end]
    return text, None


def test_cut_at_the_stop_and_drop_it() -> None:
    assert stream(["\nUser:"], ["Hello.\nUser: more"])[:2] == ("Hello.", "\nUser:")


def test_partial_stop_is_held_back_then_released() -> None:
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == ("42 ", None)
    assert matcher.feed("wer>") == ("", "</answer>")
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("a </an") == ("a ", None)
    assert matcher.feed("d b") == ("</and b", None)


def test_held_text_is_flushed_at_the_end() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", None)
    assert matcher.finish() == "ST"


def test_first_complete_match_wins() -> None:
    # "bc" is complete before "abcd" is: the answer the stream would give, so also the answer for the whole text.
    assert stream(["abcd", "bc"], ["abcd"])[:2] == ("a", "bc")
    assert stream(["ab", "abc"], ["xabc"])[:2] == ("x", "ab")


def test_after_a_match_nothing_more_comes_out() -> None:
    matcher = StopMatcher(["X"])
    assert matcher.feed("aXb") == ("a", "X")
    assert matcher.feed("more") == ("", None)
    assert matcher.finish() == ""
    assert matcher.matched == "X"


def test_no_stops_passes_everything_at_once() -> None:
    assert StopMatcher([]).feed("anything") == ("anything", None)
    assert StopMatcher([""]).feed("anything") == ("anything", None)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n<", max_size=30),
    stops=st.lists(st.text(alphabet="abc\n<", min_size=1, max_size=4), min_size=1, max_size=3),
    points=st.lists(st.integers(0, 30), max_size=10),
)
def test_any_chunking_matches_the_reference(text: str, stops: list[str], points: list[int]) -> None:
    cuts = sorted({0, len(text), *(p for p in points if p <= len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(cuts)]
    shown, matched, pieces = stream(stops, chunks)
    assert (shown, matched) == reference(stops, text)
    # No piece shown may end with the start of a stop sequence that then completed.
    if matched is not None:
        assert not any(matched in "".join(pieces[: i + 1]) for i in range(len(pieces)))
