"""Prompts as chained block hashes for router tests (the real contracts.block_hash function)."""

from __future__ import annotations

from contracts.block_hash import hash_namespace, lookup_block_hashes

BLOCK_SIZE = 16
NAMESPACE = hash_namespace("test-model", "test-tokenizer", BLOCK_SIZE)


def prompt_tokens(conversation: int, length: int) -> list[int]:
    """A deterministic prompt; prompts of one conversation share every prefix."""
    return [(conversation * 7919 + position) % 50_000 for position in range(length)]


def lookup_hashes(tokens: list[int]) -> list[bytes]:
    return lookup_block_hashes(NAMESPACE, tokens, BLOCK_SIZE)
