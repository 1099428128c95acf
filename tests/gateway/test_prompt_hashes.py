"""The gateway's hashes of a prompt: the rank's chain over every full block, continued over a stream's
continuation, and the router's lookup hashes taken from it (one token short of the end)."""

from __future__ import annotations

import pytest

from contracts.block_hash import hash_namespace, lookup_block_hashes, prefix_block_hashes
from gateway.ranks.prompt_hashes import prompt_block_hashes, route_block_hashes
from protos import rank_worker_pb2 as pb

BLOCK = 16
INFO = pb.ModelInfoResponse(block_size=BLOCK, hash_namespace=hash_namespace("m", "tok", BLOCK))


def tokens(count: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50_000 for i in range(count)]


@pytest.mark.parametrize("length", [0, 5, 16, 17, 160, 165])
def test_the_prompt_hashes_are_the_chain_over_its_full_blocks(length: int) -> None:
    prompt = tokens(length)
    hashes = prompt_block_hashes(INFO, prompt)
    assert hashes == prefix_block_hashes(INFO.hash_namespace, prompt, BLOCK)
    assert len(hashes) == length // BLOCK
    assert route_block_hashes(INFO, length, hashes) == lookup_block_hashes(INFO.hash_namespace, prompt, BLOCK)


@pytest.mark.parametrize(("prompt_length", "continued"), [(165, 40), (160, 16), (10, 3), (0, 20)])
def test_a_continued_prompt_extends_the_chain_it_started_with(prompt_length: int, continued: int) -> None:
    prompt, output = tokens(prompt_length), tokens(continued, seed=1)
    known = prompt_block_hashes(INFO, prompt)
    extended = prompt_block_hashes(INFO, prompt + output, known)
    assert extended == prefix_block_hashes(INFO.hash_namespace, prompt + output, BLOCK)
    assert extended[: len(known)] == known


def test_a_model_without_block_size_or_namespace_gets_no_hashes() -> None:
    assert prompt_block_hashes(pb.ModelInfoResponse(hash_namespace=INFO.hash_namespace), tokens(100)) == []
    assert prompt_block_hashes(pb.ModelInfoResponse(block_size=BLOCK), tokens(100)) == []
    assert route_block_hashes(pb.ModelInfoResponse(), 100, []) == []
