"""A `tokenizers` tokenizer rebuilt from GGUF metadata, serialized as tokenizer.json text for the TokenizerBundle.

A GGUF carries no tokenizer.json, only llama.cpp's description: the token list (with a type per token),
the BPE merges or sentencepiece scores, and a name for the pre-tokenizer ("tokenizer.ggml.pre"). We rebuild
what llama.cpp runs for that description, so ids match llama.cpp and the original Hugging Face tokenizer.
The tokenizer.json has no post-processor: whether a BOS goes in front is the bundle's add_bos_token.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from rank_worker.engine.interface import TokenizerBundle
from rank_worker.model_files.source import ModelPathError

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of the pre-tokenizers llama.cpp names in tokenizer.ggml.pre (see its llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
# StarCoder-family vocabularies (SmolLM included) were trained on digits split one by one, then GPT-2 words.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact"}
# llama.cpp takes a word that is already a token whole instead of merging up to it, for Llama 3 vocabularies.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe"}
_GPT2_PRE = {"default", "gpt-2", "gpt2"}


def tokenizer_from_metadata(metadata: dict[str, Any], path: Path) -> TokenizerBundle | None:
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if kind is None or not tokens:
        log.warning("GGUF %s carries no tokenizer; requests must come as token ids", path)
        return None
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelPathError(f"GGUF {path} lists {len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        tokenizer = byte_level_bpe(tokens, types, metadata.get("tokenizer.ggml.merges") or [], metadata)
    elif kind == "llama":
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        tokenizer = sentencepiece_bpe(tokens, types, scores, metadata)
    else:
        raise ModelPathError(
            f"GGUF {path} has tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), 'llama' (sentencepiece)"
        )

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    # eot/eom end a turn or a tool message in Llama 3 style chats; generation must stop on them like on eos.
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos_ids = tuple(dict.fromkeys(int(i) for k in eos_keys if (i := metadata.get(f"tokenizer.ggml.{k}")) is not None))
    # llama.cpp's default when the flag is absent: sentencepiece vocabularies get a BOS, byte-level ones do not.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return TokenizerBundle(
        tokenizer_json=tokenizer.to_str(),
        chat_template=metadata.get("tokenizer.chat_template") or "",
        bos_token_id=None if bos_id is None else int(bos_id),
        eos_token_ids=eos_ids,
        bos_token=tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else "",
        eos_token=tokens[eos_ids[0]] if eos_ids and eos_ids[0] < len(tokens) else "",
        add_bos_token=bool(add_bos),
    )


def byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], metadata: dict[str, Any]) -> Tokenizer:
    """GPT-2 style BPE over bytes spelled as printable characters (bytes_to_chars)."""
    byte_chars = bytes_to_chars()
    alphabet = set(byte_chars.values())

    def spelled(index: int, token: str) -> str:
        # Added tokens are stored as the raw text they match; ordinary ones already in the byte alphabet.
        # An ordinary one that is not (a converter quirk) is re-spelled so BPE can still reach it.
        if types[index] in (CONTROL, USER_DEFINED) or set(token) <= alphabet:
            return token
        return "".join(byte_chars[b] for b in token.encode("utf-8"))

    pre = metadata.get("tokenizer.ggml.pre", "default")
    model = models.BPE(
        vocab=_vocab(tokens, spelled),
        merges=[tuple(merge.split(" ", 1)) for merge in merges],
        ignore_merges=pre in _IGNORE_MERGES,
    )
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, tokens, types, special_types=(CONTROL,))
    return tokenizer


def sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float], metadata: dict[str, Any]) -> Tokenizer:
    """Llama 1/2, Mistral 7B style sentencepiece BPE: "▁" for spaces, <0xNN> tokens for bytes not in the vocab."""
    vocab = _vocab(tokens, lambda _i, token: token)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=vocab,
        merges=merges_from_scores(tokens, types, scores, vocab),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    # llama.cpp puts a space before the text and after each special token (sentencepiece's "add dummy prefix").
    add_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    undo = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*undo, decoders.Strip(" ", 1, 0)] if add_prefix else undo)
    _add_special_tokens(tokenizer, tokens, types, special_types=(CONTROL, UNKNOWN))
    return tokenizer


def merges_from_scores(tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]) -> list:
    """BPE merges equivalent to sentencepiece's rule "join the adjacent pair whose result scores highest".

    Every way of cutting an ordinary token into two tokens is a merge, ranked by the whole token's score.
    """
    ranked = []
    for index, token in enumerate(tokens):
        if types[index] != NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def bytes_to_chars() -> dict[int, str]:
    """GPT-2's printable spelling of bytes: printable Latin-1 bytes stand for themselves, the other 68 bytes
    (controls, space, a few Latin-1 gaps) borrow the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    borrowed = (b for b in range(256) if b not in chars)
    for offset, byte in enumerate(borrowed):
        chars[byte] = chr(256 + offset)
    return dict(sorted(chars.items()))


def _vocab(tokens: list[str], spelled: Any) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        key = spelled(index, token)
        if key in vocab:
            # Two ids with one spelling: keep ids contiguous (the model's rows) with a name no text produces.
            log.debug("GGUF token %d duplicates %r", index, key)
            key = f"<gguf-duplicate-{index}>"
        vocab[key] = index
    return vocab


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in _GPT2_PRE:
        log.warning("unknown GGUF pre-tokenizer %r; splitting words the GPT-2 way", pre)
    return gpt2


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int], special_types: tuple) -> None:
    """Make added tokens match whole in the input (not be cut up by BPE). Control tokens are special (dropped
    by decode(skip_special_tokens=True)); user-defined ones, like <think>, are ordinary text."""
    special = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k in special_types
    ]
    plain = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
