"""Turn a stream of token ids into a stream of text that never shows half a character.

A byte-level token can end in the middle of a UTF-8 sequence (an emoji is often 2-4 tokens); decoding
it alone yields U+FFFD. We hold text back while the decoded tail ends in U+FFFD, and decode each step
with the previously emitted tokens as context, because some decoders (SentencePiece's leading-space
rule) render a token differently at the start of a text than after other tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        self._context_start = 0  # first token of the context window decoded with the new tokens
        self._emitted_end = 0  # tokens before this index have been emitted as text

    def push(self, token_ids: Iterable[int]) -> str:
        """Text that the new tokens complete (possibly empty while a character is still incomplete)."""
        self._token_ids.extend(token_ids)
        context_text, window_text = self._decode_window()
        if window_text.endswith(REPLACEMENT_CHAR) or len(window_text) <= len(context_text):
            return ""
        self._context_start = self._emitted_end
        self._emitted_end = len(self._token_ids)
        return window_text[len(context_text) :]

    def finish(self) -> str:
        """Whatever is still held back once the stream has ended (a dangling byte shows as U+FFFD)."""
        context_text, window_text = self._decode_window()
        self._context_start = self._emitted_end = len(self._token_ids)
        return window_text[len(context_text) :]

    @property
    def token_ids(self) -> list[int]:
        return list(self._token_ids)

    def _decode_window(self) -> tuple[str, str]:
        context = self._token_ids[self._context_start : self._emitted_end]
        window = self._token_ids[self._context_start :]
        decode = self._tokenizer.decode
        return decode(context, skip_special_tokens=self._skip_special_tokens), decode(
            window, skip_special_tokens=self._skip_special_tokens
        )
