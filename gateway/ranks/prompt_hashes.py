"""The prompt's chained block hashes in the served model's namespace, computed once per request off the event
loop (100K tokens take about 19 ms): the router scores ranks by them, and the rank takes them with the
request instead of hashing the prompt again."""

from __future__ import annotations

from collections.abc import Sequence

from contracts.block_hash import lookup_block_count, prefix_block_hashes
from protos import rank_worker_pb2 as pb


def prompt_block_hashes(
    info: pb.ModelInfoResponse, token_ids: Sequence[int], known: Sequence[bytes] = ()
) -> list[bytes]:
    """Hashes of every full block of token_ids, continuing `known` (the hashes of its first len(known) full
    blocks, already computed); none for a model that names no block size or namespace (no prefix cache)."""
    block_size = info.block_size
    if block_size <= 0 or not info.hash_namespace:
        return []
    begin = len(known) * block_size
    parent = known[-1] if known else None
    rest = token_ids[begin:] if begin else token_ids
    return [*known, *prefix_block_hashes(info.hash_namespace, rest, block_size, parent)]


def route_block_hashes(info: pb.ModelInfoResponse, prompt_tokens: int, hashes: list[bytes]) -> list[bytes]:
    """Of a prompt's full-block hashes, those a cache may serve (lookup_block_count): what the router scores."""
    if info.block_size <= 0:
        return []
    count = lookup_block_count(prompt_tokens, info.block_size)
    return hashes if count == len(hashes) else hashes[:count]
