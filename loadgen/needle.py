"""The needle quality gate without transport: the long document with one hidden fact, its fit to a token
budget, the lengths to test, and the verdict that compares a cold answer with the same request answered
from cache.

The gate is cold == warm at temperature 0: a prefix-cache bug (wrong blocks, stale KV, an off-by-one at the
cached boundary) changes the greedy answer. Whether the answer contains the fact is reported but does not
gate, because a small model may simply not find the needle."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

START_LENGTH = 4096
DEFAULT_MIN_WARM_HIT = 0.5  # below this the warm request mostly recomputed: the gate compared nothing

_COLORS = ("blue", "amber", "crimson", "green", "silver", "violet", "golden", "black", "white", "copper")
_PLACES = ("vault", "locker", "archive", "cellar", "tower", "chest", "garage", "workshop", "library", "boathouse")

# Filler vocabulary: no digits and no "secret"/"code", so the needle is the only thing the question can match.
_SUBJECTS = (
    "the old lighthouse keeper",
    "a quiet river",
    "the village baker",
    "a travelling musician",
    "the north wind",
    "an elderly gardener",
    "the harbour master",
    "a curious fox",
    "the mountain guide",
    "a young carpenter",
    "the night train",
    "a patient teacher",
    "the city library",
    "a flock of starlings",
    "the weaver next door",
    "a retired sailor",
    "the market square",
    "a tired shepherd",
    "the glass blower",
    "a wandering poet",
    "the orchard owner",
    "a small fishing boat",
    "the clock tower",
    "a stubborn mule",
    "the school choir",
)
_VERBS = (
    "carried",
    "painted",
    "remembered",
    "repaired",
    "described",
    "followed",
    "collected",
    "polished",
    "ignored",
    "admired",
    "questioned",
    "measured",
    "sheltered",
    "borrowed",
    "celebrated",
    "watched",
    "arranged",
    "discovered",
    "sketched",
    "praised",
)
_OBJECTS = (
    "a basket of apples",
    "the broken fence",
    "an old map of the coast",
    "the morning fog",
    "a bundle of letters",
    "the narrow bridge",
    "a jar of honey",
    "the fading mural",
    "a pair of leather boots",
    "the long shadows",
    "a song about the sea",
    "the heavy wooden door",
    "a lantern with green glass",
    "the empty benches",
    "a story about the winter",
    "the crooked chimney",
    "a bowl of warm soup",
    "the stones of the pier",
    "a faded blue umbrella",
    "the rows of cabbages",
)
_ENDINGS = (
    "before the rain began",
    "while the bells were ringing",
    "without saying a word",
    "under a pale sky",
    "as the tide went out",
    "after a long and dusty journey",
    "in the early hours of the morning",
    "with great care",
    "just before supper",
    "when nobody was looking",
    "on the way to the market",
    "beside the frozen pond",
    "during the harvest festival",
    "at the edge of the forest",
    "for the last time",
)
_LINKS = ("Later,", "Meanwhile,", "Some say that", "Everyone agreed that", "In those days", "Once again,", "Oddly,")


@dataclass(frozen=True)
class Needle:
    """The one fact hidden in a document, and the question that asks for it."""

    subject: str  # e.g. "blue vault"
    code: str  # four digits, e.g. "7341"

    @property
    def fact(self) -> str:
        return f"The secret code of the {self.subject} is {self.code}."

    @property
    def question(self) -> str:
        return f"What is the secret code of the {self.subject}? Answer with the number only."

    def found_in(self, answer: str) -> bool:
        """Whether the answer states the code (as a number of its own, not inside a longer one)."""
        return re.search(rf"(?<!\d){self.code}(?!\d)", answer) is not None


@dataclass(frozen=True)
class NeedleDocument:
    """A document of filler with the needle's fact at `needle_offset`, and the prompt that asks about it."""

    text: str
    nonce: str
    needle: Needle
    depth: float  # requested position of the fact, as a fraction of the filler
    needle_offset: int  # character offset of the fact in `text`

    @property
    def prompt(self) -> str:
        return f"{self.text}\n\n{self.needle.question}"

    @property
    def actual_depth(self) -> float:
        return self.needle_offset / max(1, len(self.text))


def make_needle(seed: int) -> Needle:
    """A needle chosen deterministically from `seed`."""
    rng = random.Random(f"needle:{seed}")
    return Needle(f"{rng.choice(_COLORS)} {rng.choice(_PLACES)}", f"{rng.randrange(1000, 10000)}")


def filler_sentences(seed: int) -> Callable[[], str]:
    """A generator of varied filler sentences, the same sequence for the same seed."""
    rng = random.Random(f"filler:{seed}")

    def sentence() -> str:
        body = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
        if rng.random() < 0.25:
            body = f"{rng.choice(_LINKS)} {body}"
        return body[0].upper() + body[1:] + "."

    return sentence


def build_document(filler_chars: int, seed: int, nonce: str, depth: float = 0.5) -> NeedleDocument:
    """About `filler_chars` characters of filler in paragraphs, opened by `nonce` (a per-run value, so no
    block of the document is cached before the cold ask), with the fact of `make_needle(seed)` inserted at
    the sentence boundary nearest `depth` (0 = first sentence, 1 = last)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], not {depth}")
    if filler_chars < 0:
        raise ValueError("filler_chars must not be negative")
    needle = make_needle(seed)
    next_sentence = filler_sentences(seed)
    rng = random.Random(f"paragraphs:{seed}")
    sentences: list[str] = []
    size = 0
    while size < filler_chars:
        sentences.append(next_sentence())
        size += len(sentences[-1]) + 1
    sentences.insert(round(depth * len(sentences)), needle.fact)

    header = f"Document {nonce}. Read it carefully; a question about it follows.\n\n"
    paragraphs: list[str] = []
    offset = len(header)
    needle_offset = -1
    start = 0
    while start < len(sentences):
        end = min(len(sentences), start + rng.randint(4, 8))
        paragraph = sentences[start:end]
        if needle.fact in paragraph:
            before = paragraph[: paragraph.index(needle.fact)]
            needle_offset = offset + sum(len(s) + 1 for s in before)
        text = " ".join(paragraph)
        paragraphs.append(text)
        offset += len(text) + 2
        start = end
    return NeedleDocument(header + "\n\n".join(paragraphs), nonce, needle, depth, needle_offset)


@dataclass(frozen=True)
class FittedDocument:
    document: NeedleDocument
    prompt_tokens: int  # as counted for the whole request (template, document and question)
    rounds: int  # how many documents were built and counted


def fit_document(
    target_tokens: int,
    count_tokens: Callable[[NeedleDocument], int],
    seed: int,
    nonce: str,
    depth: float = 0.5,
    tolerance: float = 0.02,
    max_rounds: int = 8,
    chars_per_token: float = 4.0,
) -> FittedDocument:
    """The document whose request counts between target*(1-tolerance) and target tokens; `count_tokens`
    measures a request (the server's tokenizer and chat template), each round rescales the filler by the
    ratio still missing. Raises ValueError if no round lands in the window."""
    if target_tokens <= 0:
        raise ValueError("target_tokens must be positive")
    low = target_tokens * (1 - tolerance)
    aim = target_tokens * (1 - tolerance / 2)  # the middle of the window, so a round rarely overshoots
    chars = int(aim * chars_per_token)
    best: FittedDocument | None = None
    for round_number in range(1, max_rounds + 1):
        document = build_document(chars, seed, nonce, depth)
        tokens = count_tokens(document)
        if low <= tokens <= target_tokens:
            return FittedDocument(document, tokens, round_number)
        if tokens <= target_tokens and (best is None or tokens > best.prompt_tokens):
            best = FittedDocument(document, tokens, round_number)
        chars = max(1, int(chars * aim / max(1, tokens)))
    raise ValueError(
        f"no document of {target_tokens} tokens within {tolerance:.0%} after {max_rounds} rounds"
        + (f" (closest below: {best.prompt_tokens})" if best else "")
    )


def parse_lengths(text: str) -> list[int] | None:
    """`auto` -> None; otherwise comma-separated token counts, a k/K suffix meaning 1024 (4k = 4096)."""
    if text.strip().lower() == "auto":
        return None
    lengths = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        scale = 1024 if item.endswith("k") else 1
        try:
            value = int(item.removesuffix("k")) * scale
        except ValueError:
            raise ValueError(f"not a length: {item!r} (use e.g. 4096,8k or auto)") from None
        if value <= 0:
            raise ValueError(f"lengths must be positive, not {value}")
        lengths.append(value)
    if not lengths:
        raise ValueError("no lengths given")
    return sorted(set(lengths))


def auto_lengths(max_context: int, start: int = START_LENGTH) -> list[int]:
    """Doubling from `start` while below the model's context, then the context itself."""
    lengths = []
    length = start
    while length < max_context:
        lengths.append(length)
        length *= 2
    if max_context >= start:
        lengths.append(max_context)
    return lengths


def plan_lengths(requested: Sequence[int], max_context: int | None) -> tuple[list[int], list[int]]:
    """(lengths to run, lengths skipped because they exceed the context); with no known context, all run
    and the server refuses those that do not fit."""
    if max_context is None:
        return list(requested), []
    return [n for n in requested if n <= max_context], [n for n in requested if n > max_context]


def prompt_budget(length: int, max_tokens: int) -> int:
    """Prompt tokens for a test of `length`: the whole exchange (prompt and answer) fits in `length`."""
    return length - max_tokens


@dataclass(frozen=True)
class Answer:
    """One response: its text and usage (input_tokens excludes what was read from cache)."""

    text: str
    input_tokens: int
    cache_read_tokens: int
    output_tokens: int
    stop_reason: str | None
    seconds: float
    thinking: str = ""  # a reasoning model's thinking blocks: compared too, a short answer may be all thinking

    @property
    def prompt_tokens(self) -> int:
        return self.input_tokens + self.cache_read_tokens

    @property
    def cache_hit(self) -> float:
        return self.cache_read_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class LengthResult:
    """The cold and warm answers to the same request at one document length."""

    length: int
    document: NeedleDocument
    prompt_tokens: int
    cold: Answer
    warm: Answer

    @property
    def match(self) -> bool:
        return (self.cold.text, self.cold.thinking) == (self.warm.text, self.warm.thinking)

    def failures(self, min_warm_hit: float = DEFAULT_MIN_WARM_HIT) -> list[str]:
        """Why this length fails the gate (empty = it passes)."""
        reasons = []
        if not self.match:
            reasons.append(f"{self.length}: warm answer differs from cold: {self.cold.text!r} vs {self.warm.text!r}")
        if self.warm.cache_hit < min_warm_hit:
            reasons.append(
                f"{self.length}: warm request read {self.warm.cache_hit:.0%} from cache (< {min_warm_hit:.0%}):"
                " the cached path was not tested"
            )
        return reasons


def gate_failures(
    results: Sequence[LengthResult],
    skipped: Sequence[int] = (),
    min_warm_hit: float = DEFAULT_MIN_WARM_HIT,
    errors: Sequence[str] = (),
) -> list[str]:
    """Every reason the gate fails: a mismatch, a warm request that missed the cache, a request that failed
    (`errors`), or no length tested at all (the gate tested nothing)."""
    failures = [reason for result in results for reason in result.failures(min_warm_hit)] + list(errors)
    if not results:
        note = f" (skipped: {', '.join(map(str, skipped))})" if skipped else ""
        failures.append(f"no length was tested{note}")
    return failures


def _answer_json(answer: Answer, needle: Needle) -> dict[str, Any]:
    return {
        "text": answer.text,
        "thinking": answer.thinking,
        "found_needle": needle.found_in(answer.text),
        "input_tokens": answer.input_tokens,
        "cache_read_input_tokens": answer.cache_read_tokens,
        "cache_hit": round(answer.cache_hit, 4),
        "output_tokens": answer.output_tokens,
        "stop_reason": answer.stop_reason,
        "seconds": round(answer.seconds, 3),
    }


def report_json(
    results: Sequence[LengthResult],
    skipped: Sequence[int],
    min_warm_hit: float,
    meta: dict[str, Any],
    errors: Sequence[str] = (),
) -> dict[str, Any]:
    """The gate's JSON report: `meta` (url, model, date ...), one entry per length, the verdict."""
    failures = gate_failures(results, skipped, min_warm_hit, errors)
    lengths = []
    for result in results:
        document = result.document
        lengths.append(
            {
                "length": result.length,
                "prompt_tokens": result.prompt_tokens,
                "needle": {"fact": document.needle.fact, "code": document.needle.code},
                "needle_depth": round(document.actual_depth, 4),
                "nonce": document.nonce,
                "cold": _answer_json(result.cold, document.needle),
                "warm": _answer_json(result.warm, document.needle),
                "match": result.match,
                "passed": not result.failures(min_warm_hit),
            }
        )
    return {
        **meta,
        "min_warm_cache_hit": min_warm_hit,
        "lengths": lengths,
        "skipped": list(skipped),
        "passed": not failures,
        "failures": failures,
    }
