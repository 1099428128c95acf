from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from contracts.block_hash import (
    BLOCK_HASH_BYTES,
    chain_block_hash,
    hash_namespace,
    lookup_block_hashes,
    prefix_block_hashes,
    tokenizer_fingerprint,
)

NS = hash_namespace("model-a", tokenizer_fingerprint("{}"), 4)


@given(st.lists(st.integers(0, 200_000), max_size=60), st.lists(st.integers(0, 200_000), max_size=60))
def test_equal_hashes_mean_equal_prefixes(a: list[int], b: list[int]) -> None:
    ha, hb = prefix_block_hashes(NS, a, 4), prefix_block_hashes(NS, b, 4)
    assert len(ha) == len(a) // 4 and all(len(h) == BLOCK_HASH_BYTES for h in ha)
    for i, (x, y) in enumerate(zip(ha, hb, strict=False)):
        assert (x == y) == (a[: 4 * (i + 1)] == b[: 4 * (i + 1)])


def test_namespace_separates_models_tokenizers_block_sizes_kv_dtypes_and_weights() -> None:
    tokens = list(range(16))
    spaces = [
        hash_namespace("model-a", tokenizer_fingerprint("{}"), 4),
        # One model id, two checkpoints (a fine-tune, a model replaced in place): never one key.
        hash_namespace("model-a", tokenizer_fingerprint("{}"), 4, "bfloat16", weights_digest="0f" * 16),
        hash_namespace("model-a", tokenizer_fingerprint("{}"), 4, "bfloat16", weights_digest="1e" * 16),
        hash_namespace("model-b", tokenizer_fingerprint("{}"), 4),
        hash_namespace("model-a", tokenizer_fingerprint('{"x":1}'), 4),
        hash_namespace("model-a", tokenizer_fingerprint("{}"), 8),
        hash_namespace("model-a", tokenizer_fingerprint("{}"), 4, "bfloat16"),
        hash_namespace("model-a", tokenizer_fingerprint("{}"), 4, "float32"),
    ]
    firsts = {prefix_block_hashes(ns, tokens, 4)[0] for ns in spaces}
    assert len(firsts) == len(spaces)


def test_chain_links_each_block_to_its_parent() -> None:
    tokens = list(range(12))
    hashes = prefix_block_hashes(NS, tokens, 4)
    assert hashes[0] == chain_block_hash(NS, tokens[:4])
    assert hashes[2] == chain_block_hash(hashes[1], tokens[8:12])


def test_lookup_stops_one_token_short_of_the_prompt_end() -> None:
    assert len(lookup_block_hashes(NS, list(range(8)), 4)) == 1  # 7 tokens -> one full block
    assert len(lookup_block_hashes(NS, list(range(9)), 4)) == 2
    assert lookup_block_hashes(NS, [], 4) == []
