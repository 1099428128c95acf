"""Tokenizing an agent's prompt once per new message, not once per turn.

A coding agent resends its whole conversation every step: at Claude Code's real size the gateway tokenized 160K-545K
tokens of text per call, 0.4-1.5 s of CPU before the rank saw the request (DeepSeek-V2-Lite agents, 2026-12-06, the
request log's tokenize_ms), while the rank served those prefixes from its cache in milliseconds. Only the last
message or two of each call are new.

A Hugging Face tokenizer first cuts the text at its added tokens and encodes each piece between them on its own, so
a rendered chat prompt cut just before each special token (the chat template's message markers) encodes piece by
piece into exactly the ids of the whole: the pieces of earlier messages are looked up, only new ones are encoded,
and those together in one call (the tokenizer encodes a batch on several cores). That holds for a split token that
is special, matched in the raw text (not normalized), takes no whitespace from its left (lstrip) and needs no word
boundary (single_word), and that no other added token can cover from an earlier start; a tokenizer without such a
token is encoded whole, as before. tests/gateway/test_segment_cache.py checks the equality on the tokenizers we
ship, over rendered conversations and random text.

The cache holds ids per piece, keyed by a 128-bit hash of the piece's text, least recently used first out past
`capacity_tokens` (about 4 bytes a token, plus ~200 bytes a piece).
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import xxhash
from tokenizers import Tokenizer

from contracts.config import TOKENIZE_CACHE_TOKENS


def split_tokens(tokenizer_json: str) -> list[str]:
    """The added tokens a prompt can be cut before without changing its encoding (the module's rule); [] where
    none qualifies or the tokenizer's JSON cannot be read."""
    try:
        spec = json.loads(tokenizer_json)
        added: list[dict[str, Any]] = spec.get("added_tokens") or []
    except (ValueError, AttributeError):
        return []
    if spec.get("truncation") or spec.get("padding"):
        return []  # each piece would be cut or padded on its own
    contents = [str(token.get("content", "")) for token in added]
    chosen = []
    for token in added:
        content = str(token.get("content", ""))
        if not content or not token.get("special") or token.get("normalized"):
            continue
        if token.get("lstrip") or token.get("single_word"):
            continue
        if any(_covers(other, content) for other in contents if other):
            continue
        chosen.append(content)
    return chosen


def _covers(other: str, token: str) -> bool:
    """Whether a match of `other` starting before an occurrence of `token` could run into it (and so take the
    place where the whole text is cut): some proper suffix of `other` starts the token, or holds it."""
    for start in range(1, len(other)):
        tail = other[start:]
        if token.startswith(tail) or tail.startswith(token):
            return True
    return False


class SegmentCache:
    """encode(text) == tokenizer.encode_batch([text], add_special_tokens=False)[0].ids, from cached pieces. Safe to
    call from several threads (the gateway prepares requests in worker threads)."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[str], capacity_tokens: int = TOKENIZE_CACHE_TOKENS):
        self.tokenizer = tokenizer
        self.capacity_tokens = capacity_tokens
        # a cut before each split token (a zero-width match: which of them matched makes no difference)
        ordered = sorted(set(tokens))
        self._cut = re.compile("(?=" + "|".join(re.escape(t) for t in ordered) + ")") if ordered else None
        self._pieces: OrderedDict[bytes, array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0  # pieces found and pieces encoded, since the start
        self.misses = 0
        # told each prompt's tokens taken from the cache and tokens encoded (the gateway's metrics)
        self.observe: Callable[[int, int], None] | None = None

    @classmethod
    def for_tokenizer_json(
        cls, tokenizer: Tokenizer, tokenizer_json: str, capacity_tokens: int = TOKENIZE_CACHE_TOKENS
    ) -> SegmentCache:
        return cls(tokenizer, split_tokens(tokenizer_json), capacity_tokens)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def encode(self, text: str) -> list[int]:
        if self._cut is None or self.capacity_tokens <= 0:
            return self._encode_all([text])[0]
        pieces = [piece for piece in self._cut.split(text) if piece]
        keys = [xxhash.xxh3_128_digest(piece.encode("utf-8", "surrogatepass")) for piece in pieces]
        found: dict[int, array] = {}
        with self._lock:
            for i, key in enumerate(keys):
                ids = self._pieces.get(key)
                if ids is not None:
                    self._pieces.move_to_end(key)
                    found[i] = ids
            self.hits += len(found)
            self.misses += len(pieces) - len(found)
        from_cache = sum(len(ids) for ids in found.values())
        # each new piece once, however often it comes (an end-of-message marker comes in every message)
        missing = {keys[i]: i for i in range(len(pieces)) if i not in found}
        fresh: dict[bytes, array] = {}
        if missing:
            encoded = self._encode_all([pieces[i] for i in missing.values()])
            fresh = {key: array("i", ids) for key, ids in zip(missing, encoded, strict=True)}
            self._remember(fresh)
        out: list[int] = []
        for i, key in enumerate(keys):
            out.extend(found[i] if i in found else fresh[key])
        if self.observe is not None:
            self.observe(from_cache, len(out) - from_cache)
        return out

    def _encode_all(self, texts: list[str]) -> list[list[int]]:
        # encode_batch lets go of the GIL (encode holds it) and spreads a batch over the tokenizer's threads
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def _remember(self, new: dict[bytes, array]) -> None:
        with self._lock:
            for key, ids in new.items():
                if key in self._pieces or len(ids) > self.capacity_tokens:
                    continue
                self._pieces[key] = ids
                self._tokens += len(ids)
            while self._tokens > self.capacity_tokens and self._pieces:
                _, dropped = self._pieces.popitem(last=False)
                self._tokens -= len(dropped)
