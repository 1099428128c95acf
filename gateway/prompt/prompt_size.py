"""A lower bound on a prompt's token count from its size alone, so that a prompt that cannot fit the context
is refused before it is tokenized (tokenizing 12 MB takes seconds of CPU; a byte count takes milliseconds).

No token of a lossless byte-level BPE tokenizer stands for more input bytes than its longest vocabulary
entry, so a text of B bytes has at least B / that many tokens. The bound is exact-safe: it never refuses a
prompt that fits. Tokenizers that can drop or shrink input (normalizers other than NFC, pre-tokenizers that
remove whitespace, non-byte-level models) get no bound, and their prompts are always counted exactly."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from gateway.http.errors import PromptTooLong

# NFC composes at most three code points' worth of UTF-8 into one character of no fewer bytes than a third.
_NORMALIZER_SHRINK = {None: 1, "NFC": 3}


def refuse_what_does_not_fit(prompt_tokens: int, max_model_len: int) -> None:
    """Raise PromptTooLong for a prompt of prompt_tokens (an exact count) that leaves no room for an answer: the
    one rule /v1/messages, /v1/chat/completions and count_tokens share."""
    if prompt_tokens >= max_model_len:
        raise PromptTooLong(
            f"prompt is too long: {prompt_tokens} tokens, and this model's context is {max_model_len} tokens "
            f"(at most {max_model_len - 1} prompt tokens leave room for an answer)"
        )


@dataclass(frozen=True)
class PromptSizeBound:
    bytes_per_token: int  # the most input bytes one token can stand for; 0: no bound for this tokenizer

    @classmethod
    def for_tokenizer_json(cls, tokenizer_json: str) -> PromptSizeBound:
        """The bound for a Hugging Face tokenizer.json; PromptSizeBound(0) when the tokenizer is not one it
        can vouch for."""
        try:
            spec = json.loads(tokenizer_json)
        except ValueError:
            return cls(0)
        model = spec.get("model") or {}
        normalizer = spec.get("normalizer")
        kind = normalizer.get("type") if isinstance(normalizer, dict) else None if normalizer is None else "?"
        shrink = _NORMALIZER_SHRINK.get(kind)
        vocab = model.get("vocab")
        if model.get("type") != "BPE" or not isinstance(vocab, dict) or not vocab or shrink is None:
            return cls(0)
        if not _byte_level(spec.get("pre_tokenizer")):
            return cls(0)
        # Byte-level vocabulary entries spell one input byte per character; added (special) tokens are
        # matched in the raw text, so they stand for their UTF-8 bytes.
        longest = max(len(token) for token in vocab)
        added = [len(str(token.get("content", "")).encode("utf-8")) for token in spec.get("added_tokens") or []]
        return cls(shrink * max([longest, *added]))

    def min_tokens(self, text: str) -> int:
        """At least this many tokens (0 when there is no bound), special tokens such as BOS not counted."""
        if self.bytes_per_token <= 0:
            return 0
        return math.ceil(len(text.encode("utf-8", "surrogatepass")) / self.bytes_per_token)

    def refuse_what_cannot_fit(self, text: str, max_model_len: int) -> None:
        """Raise PromptTooLong (not counted) when the text needs max_model_len tokens or more (which leaves no room
        for an answer, the same rule as for an exact count)."""
        at_least = self.min_tokens(text)
        if at_least >= max_model_len:
            raise PromptTooLong(
                f"prompt is too long: at least {at_least} tokens ({len(text.encode('utf-8', 'surrogatepass'))} "
                f"bytes), and this model's context is {max_model_len} tokens "
                f"(at most {max_model_len - 1} prompt tokens leave room for an answer)",
                counted=False,
            )


def _byte_level(pre_tokenizer: Any) -> bool:
    """A ByteLevel pre-tokenizer (alone or in a Sequence whose other steps only split, never drop)."""
    if not isinstance(pre_tokenizer, dict):
        return False
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel":
        return True
    if kind != "Sequence":
        return False
    steps = pre_tokenizer.get("pretokenizers") or []
    lossless = all(_keeps_every_byte(step) for step in steps)
    return lossless and any(isinstance(step, dict) and step.get("type") == "ByteLevel" for step in steps)


def _keeps_every_byte(step: Any) -> bool:
    if not isinstance(step, dict):
        return False
    kind = step.get("type")
    # Splitting keeps every byte in some piece, unless the behaviour is Removed (it drops what matched).
    return kind in ("ByteLevel", "Digits", "Punctuation", "Split") and step.get("behavior") != "Removed"
