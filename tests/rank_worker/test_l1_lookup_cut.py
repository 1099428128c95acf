"""A host-tier lookup answered when others' admissions had taken the free pool meanwhile (no room for any of its
blocks): the sequence looks its blocks up again rather than compute what L1 holds, a bounded number of times. In
the CPU probe's bursts such sequences were admitted at once and computed whole sessions L1 still held."""

from __future__ import annotations

from collections.abc import Callable

from engine_fixtures import greedy, random_prompt

from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.kv_cache_manager import MAX_LOOKUPS_CUT, KvCacheManager
from rank_worker.engine.sequence import Sequence, SequenceStatus
from rank_worker.l1.host_fetch import HostFetch

BLOCK = 16


class AnsweredLater:
    """A host tier that holds every block and answers each lookup when the test says, with no room."""

    def __init__(self) -> None:
        self.fetches: list[HostFetch] = []
        self.abandoned: list[HostFetch] = []

    def fetch(self, prefix: list[bytes], block_hashes: list[bytes], room: Callable[[int], int]) -> HostFetch:
        fetch = HostFetch(list(prefix), list(block_hashes), room, deadline=0.0, expected=len(block_hashes))
        self.fetches.append(fetch)
        return fetch

    def answer_with_no_room(self) -> None:
        fetch = self.fetches[-1]
        fetch.cut, fetch.done = len(fetch.hashes), True

    def abandon(self, fetch: HostFetch) -> None:
        self.abandoned.append(fetch)

    def offload(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        pass

    def known_run(self, block_hashes: list[bytes]) -> int:
        return len(block_hashes)


def test_a_lookup_cut_to_nothing_is_made_again_a_bounded_number_of_times() -> None:
    tier = AnsweredLater()
    kv = KvCacheManager(BlockPool(100, caching=True), BLOCK, b"lookup-cut", tier)
    seq = Sequence("a", random_prompt(20 * BLOCK + 3, 128, seed=5), 20 * BLOCK + 3, greedy(4), arrival_time=0.0)
    for lookup in range(1, MAX_LOOKUPS_CUT + 2):
        assert kv.waits_for_host(seq, 256), "a lookup starts: the sequence waits for it"
        assert len(tier.fetches) == lookup and seq.status is SequenceStatus.WAITING_FOR_L1
        tier.answer_with_no_room()
        if lookup <= MAX_LOOKUPS_CUT:
            assert kv.waits_for_host(seq, 256), "cut to nothing: it waits, to look its blocks up again"
            assert seq.host_fetch is None and seq.l1_lookups_cut == lookup
    assert not kv.waits_for_host(seq, 256), "the last cut: admitted, it computes what L1 could not restore"
    assert seq.l1_lookups_cut == MAX_LOOKUPS_CUT and len(tier.fetches) == MAX_LOOKUPS_CUT + 1
    assert tier.abandoned == [], "every fetch was answered: none given up"
