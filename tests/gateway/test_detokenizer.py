"""The incremental detokenizer: text as soon as characters are complete, never half a UTF-8 character."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from gateway.prompt.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """One token per byte, no merges: every multi-byte character is split across tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], step: int = 1) -> list[str]:
    return [detokenizer.push(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]


@pytest.mark.parametrize("step", [1, 2, 3])
def test_multibyte_characters_split_across_tokens(byte_tokenizer: Tokenizer, step: int) -> None:
    text = "héllo 😀 wörld ✓ 漢字"
    ids = byte_tokenizer.encode(text).ids
    assert len(ids) == len(text.encode())  # really one token per byte
    detokenizer = IncrementalDetokenizer(byte_tokenizer)
    pieces = stream(detokenizer, ids, step)
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
    assert "".join(pieces) + detokenizer.finish() == text


def test_character_appears_with_its_last_byte(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("a😀").ids  # 1 + 4 tokens
    detokenizer = IncrementalDetokenizer(byte_tokenizer)
    assert stream(detokenizer, ids) == ["a", "", "", "", "😀"]
    assert detokenizer.finish() == ""


def test_dangling_bytes_are_flushed_at_the_end(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("ok😀").ids[:-2]  # the stream stopped inside the emoji
    detokenizer = IncrementalDetokenizer(byte_tokenizer)
    assert "".join(stream(detokenizer, ids)) == "ok"
    assert detokenizer.finish() == REPLACEMENT_CHAR


def test_leading_space_rule_uses_the_previous_tokens_as_context() -> None:
    # SentencePiece-style: "▁world" decodes to "world" at the start of a text but " world" after a word.
    tokenizer = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    tokenizer.decoder = decoders.Metaspace()
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push([0]), detokenizer.push([1]), detokenizer.push([1])] == ["Hello", " world", " world"]


def test_special_tokens_are_skipped() -> None:
    tokenizer = Tokenizer(models.WordLevel({"hi": 0, "<|end|>": 1, "<unk>": 2}, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<|end|>"])
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push([0]) == "hi"
    assert detokenizer.push([1]) == ""
    assert detokenizer.token_ids == [0, 1]
