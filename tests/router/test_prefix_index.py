"""The prefix index: L0 runs per rank, L1 continuation, events, clearing, and slot reuse."""

from __future__ import annotations

from router_prompts import lookup_hashes, prompt_tokens

from contracts.kv_events import KvEvent, KvEventKind
from router.prefix_index import PrefixIndex, PrefixMatch


def hashes(count: int, conversation: int = 1) -> list[bytes]:
    result = lookup_hashes(prompt_tokens(conversation, count * 16 + 1))
    assert len(result) == count
    return result


def test_leading_run_per_rank_stops_at_the_first_missing_block() -> None:
    index = PrefixIndex()
    prompt = hashes(10)
    index.stored("a", prompt[:6])
    index.stored("b", prompt[:2] + prompt[3:10])  # a hole at 2: only 2 leading blocks count
    index.stored("c", hashes(5, conversation=2))
    matches = index.match(prompt, ["a", "b", "c", "unknown"])
    assert matches == {
        "a": PrefixMatch(6, 0),
        "b": PrefixMatch(2, 0),
        "c": PrefixMatch(0, 0),
        "unknown": PrefixMatch(0, 0),
    }


def test_whole_prompt_held_counts_every_block() -> None:
    index = PrefixIndex()
    prompt = hashes(4)
    index.stored("a", prompt)
    assert index.match(prompt, ["a"])["a"] == PrefixMatch(4, 0)


def test_l1_continues_after_the_l0_run() -> None:
    index = PrefixIndex()
    prompt = hashes(10)
    index.stored("a", prompt[:3])
    index.apply_l1([KvEvent(KvEventKind.STORED, tuple(prompt[:8]))])
    matches = index.match(prompt, ["a", "b"])
    assert matches["a"] == PrefixMatch(3, 5), "L1 blocks 3..7 continue a's L0 run"
    assert matches["b"] == PrefixMatch(0, 8), "a rank with nothing in L0 restores all of L1's run"
    index.apply_l1([KvEvent(KvEventKind.REMOVED, (prompt[4],))])
    assert index.match(prompt, ["a"])["a"] == PrefixMatch(3, 1)
    index.apply_l1([KvEvent(KvEventKind.ALL_CLEARED)])
    assert index.l1_blocks == 0


def test_events_store_remove_and_all_cleared() -> None:
    index = PrefixIndex()
    prompt = hashes(5)
    index.apply("a", [KvEvent(KvEventKind.STORED, tuple(prompt)), KvEvent(KvEventKind.REMOVED, (prompt[3],))])
    assert index.match(prompt, ["a"])["a"].l0_blocks == 3
    assert index.l0_blocks("a") == 4
    index.apply("a", [KvEvent(KvEventKind.ALL_CLEARED), KvEvent(KvEventKind.STORED, (prompt[0],))])
    assert index.l0_blocks("a") == 1
    index.removed("never-seen", prompt)  # harmless


def test_clear_rank_leaves_other_ranks_and_reuses_the_slot() -> None:
    index = PrefixIndex()
    prompt = hashes(6)
    index.stored("a", prompt)
    index.stored("b", prompt[:4])
    index.clear_rank("a")
    assert index.l0_blocks("a") == 0
    assert index.match(prompt, ["a", "b"]) == {"a": PrefixMatch(0, 0), "b": PrefixMatch(4, 0)}
    index.stored("c", prompt[:1])  # takes a's freed slot: must not inherit a's blocks
    assert index.match(prompt, ["b", "c"]) == {"b": PrefixMatch(4, 0), "c": PrefixMatch(1, 0)}
    index.clear_rank("b")
    index.clear_rank("c")
    assert index._holders == {}, "no hash is kept once no rank holds it"


def test_many_ranks_beyond_small_int_masks() -> None:
    index = PrefixIndex()
    prompt = hashes(8)
    for rank in range(70):
        index.stored(f"r{rank}", prompt[: rank % 9])
    matches = index.match(prompt, [f"r{rank}" for rank in range(70)])
    assert all(matches[f"r{rank}"].l0_blocks == rank % 9 for rank in range(70))
