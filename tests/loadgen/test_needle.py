"""The needle gate's pure parts: the document (structure, determinism, needle placement), its fit to a token
budget, the lengths, and the verdict (a warm answer that differs from the cold one fails the gate)."""

from __future__ import annotations

import re

import pytest

from loadgen.needle import (
    Answer,
    LengthResult,
    NeedleDocument,
    auto_lengths,
    build_document,
    filler_sentences,
    fit_document,
    gate_failures,
    make_needle,
    parse_lengths,
    plan_lengths,
    prompt_budget,
    report_json,
)


def _filler(document: NeedleDocument) -> str:
    """The document without its header (which carries the nonce) and without the fact."""
    body = document.text.split("\n\n", 1)[1]
    return body.replace(document.needle.fact, "")


def test_needle_is_deterministic_and_varies_with_the_seed() -> None:
    assert make_needle(7) == make_needle(7)
    needles = {make_needle(seed) for seed in range(50)}
    assert len(needles) > 40
    for needle in needles:
        assert re.fullmatch(r"\d{4}", needle.code)
        assert needle.fact == f"The secret code of the {needle.subject} is {needle.code}."
        assert needle.subject in needle.question and needle.code not in needle.question


def test_found_in_wants_the_code_as_a_number_of_its_own() -> None:
    needle = make_needle(3)
    assert needle.found_in(needle.code)
    assert needle.found_in(f"The code is {needle.code}.")
    assert not needle.found_in(f"1{needle.code}")
    assert not needle.found_in(f"{needle.code}9")
    assert not needle.found_in("I do not know.")


def test_document_is_deterministic_for_seed_and_nonce() -> None:
    first = build_document(20_000, seed=11, nonce="abc123", depth=0.3)
    again = build_document(20_000, seed=11, nonce="abc123", depth=0.3)
    assert first == again
    other_seed = build_document(20_000, seed=12, nonce="abc123", depth=0.3)
    assert _filler(other_seed) != _filler(first)


def test_nonce_opens_the_document_and_is_all_that_changes_with_it() -> None:
    first = build_document(10_000, seed=5, nonce="nonce-one")
    second = build_document(10_000, seed=5, nonce="nonce-two")
    # The nonce is in the first line, so no block of a new run's document matches one cached before.
    assert first.text.startswith("Document nonce-one.") and second.text.startswith("Document nonce-two.")
    assert first.text[:30] != second.text[:30]
    assert _filler(first) == _filler(second)
    assert first.needle == second.needle


def test_filler_size_structure_and_variety() -> None:
    document = build_document(40_000, seed=1, nonce="n")
    filler = _filler(document)
    assert 40_000 <= len(filler) <= 40_000 + 400  # overshoots by at most the last sentence (and separators)
    paragraphs = document.text.split("\n\n")
    assert len(paragraphs) > 40  # a header and many paragraphs, not one block of text
    sentences = [s for s in re.split(r"(?<=\.)\s+", filler) if s]
    assert len(set(sentences)) / len(sentences) > 0.95  # varied, not one line repeated
    # Nothing in the filler can answer the question: no digits, no "secret code".
    assert not re.search(r"\d", filler)
    assert "secret" not in filler.lower()


def test_filler_sentences_repeat_for_a_seed() -> None:
    first, second = filler_sentences(4), filler_sentences(4)
    assert [first() for _ in range(20)] == [second() for _ in range(20)]


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
def test_needle_appears_once_at_its_depth(depth: float) -> None:
    document = build_document(30_000, seed=2, nonce="n", depth=depth)
    fact = document.needle.fact
    assert document.text.count(fact) == 1
    assert document.text[document.needle_offset : document.needle_offset + len(fact)] == fact
    assert document.actual_depth == pytest.approx(depth, abs=0.02)
    # The fact is a whole sentence: it starts a line or follows a sentence's end.
    before = document.text[: document.needle_offset]
    assert before.endswith((". ", "\n\n"))
    assert document.prompt.endswith(document.needle.question)


def test_document_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="depth"):
        build_document(1000, seed=0, nonce="n", depth=1.5)
    with pytest.raises(ValueError):
        build_document(-1, seed=0, nonce="n")


def _word_counter(overhead: int = 40) -> tuple[list[int], object]:
    calls: list[int] = []

    def count(document: NeedleDocument) -> int:
        # Roughly a tokenizer: words and punctuation, plus a fixed chat-template overhead.
        tokens = overhead + len(re.findall(r"\w+|[^\w\s]", document.prompt))
        calls.append(tokens)
        return tokens

    return calls, count


@pytest.mark.parametrize("target", [4080, 8176, 32752])
def test_fit_document_lands_in_the_window_below_the_target(target: int) -> None:
    calls, count = _word_counter()
    fitted = fit_document(target, count, seed=9, nonce="fit", tolerance=0.02)
    assert target * 0.98 <= fitted.prompt_tokens <= target
    assert fitted.prompt_tokens == count(fitted.document)
    assert fitted.rounds == len(calls) - 1 <= 8
    assert fitted.document.text.count(fitted.document.needle.fact) == 1


def test_fit_document_gives_up_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no document of 1000 tokens"):
        fit_document(1000, lambda document: 5000, seed=0, nonce="n", max_rounds=3)


def test_lengths_parsing() -> None:
    assert parse_lengths("auto") is None
    assert parse_lengths(" AUTO ") is None
    assert parse_lengths("8192,4096") == [4096, 8192]
    assert parse_lengths("4k, 32K,4096") == [4096, 32768]
    for bad in ("", "four", "4096,-1", "0"):
        with pytest.raises(ValueError):
            parse_lengths(bad)


def test_auto_lengths_double_up_to_the_context() -> None:
    assert auto_lengths(8192) == [4096, 8192]
    assert auto_lengths(32768) == [4096, 8192, 16384, 32768]
    assert auto_lengths(20000) == [4096, 8192, 16384, 20000]
    assert auto_lengths(4096) == [4096]
    assert auto_lengths(2048) == []


def test_plan_skips_what_does_not_fit() -> None:
    assert plan_lengths([4096, 8192, 16384], 8192) == ([4096, 8192], [16384])
    assert plan_lengths([4096, 8192], None) == ([4096, 8192], [])
    assert prompt_budget(4096, 16) == 4080


def _answer(text: str, uncached: int, cached: int) -> Answer:
    return Answer(text, uncached, cached, output_tokens=5, stop_reason="end_turn", seconds=1.0)


def _result(cold_text: str, warm_text: str, warm_cached: int = 4000) -> LengthResult:
    document = build_document(1000, seed=0, nonce="v")
    return LengthResult(
        4096, document, 4080, cold=_answer(cold_text, 4080, 0), warm=_answer(warm_text, 4080 - warm_cached, warm_cached)
    )


def test_answer_cache_hit_is_cached_over_the_whole_prompt() -> None:
    answer = _answer("x", 80, 4000)
    assert answer.prompt_tokens == 4080
    assert answer.cache_hit == pytest.approx(4000 / 4080)
    assert _answer("x", 0, 0).cache_hit == 0.0


def test_identical_answers_with_a_warm_hit_pass() -> None:
    result = _result("The code is 1234.", "The code is 1234.")
    assert result.match
    assert result.failures() == []
    assert gate_failures([result]) == []


def test_different_answers_fail_the_gate() -> None:
    result = _result("The code is 1234.", "The code is 1243.")
    assert not result.match
    failures = gate_failures([result, _result("a", "a")])
    assert len(failures) == 1 and "differs" in failures[0]
    # Even a difference in whitespace fails: the gate wants the same text.
    assert gate_failures([_result("1234", "1234 ")])


def test_different_thinking_fails_the_gate() -> None:
    same = _result("1234", "1234")
    cold = Answer("1234", 4080, 0, 5, "end_turn", 1.0, thinking="the vault is blue")
    warm = Answer("1234", 80, 4000, 5, "end_turn", 1.0, thinking="the vault is green")
    assert LengthResult(4096, same.document, 4080, cold, warm).failures()
    warm_same = Answer("1234", 80, 4000, 5, "end_turn", 1.0, thinking="the vault is blue")
    assert not LengthResult(4096, same.document, 4080, cold, warm_same).failures()


def test_a_warm_request_that_missed_the_cache_fails_the_gate() -> None:
    result = _result("same", "same", warm_cached=1000)  # 25% read from cache
    assert result.match
    failures = gate_failures([result], min_warm_hit=0.5)
    assert len(failures) == 1 and "from cache" in failures[0]
    assert gate_failures([result], min_warm_hit=0.2) == []


def test_nothing_tested_or_a_failed_request_fails_the_gate() -> None:
    assert gate_failures([], skipped=[16384]) == ["no length was tested (skipped: 16384)"]
    assert gate_failures([_result("a", "a")], errors=["8192: timed out"]) == ["8192: timed out"]


def test_report_json_carries_the_verdict_per_length() -> None:
    good, bad = _result("1234", "1234"), _result("1234", "9999")
    report = report_json([good, bad], [65536], 0.5, {"model": "m"})
    assert report["model"] == "m" and report["skipped"] == [65536]
    assert [entry["passed"] for entry in report["lengths"]] == [True, False]
    assert [entry["match"] for entry in report["lengths"]] == [True, False]
    assert report["passed"] is False and len(report["failures"]) == 1
    entry = report["lengths"][0]
    assert entry["warm"]["cache_hit"] == pytest.approx(4000 / 4080, abs=1e-4)
    assert entry["needle"]["code"] == good.document.needle.code
    assert report_json([good], [], 0.5, {})["passed"] is True
