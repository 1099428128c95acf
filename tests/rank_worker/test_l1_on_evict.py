"""Exclusive tiers (l1_write_through on_evict) against the real kvstore process: nothing is written through, each
block L0 evicts that L1 lacks is copied into a slot the rank reserved ahead, and the sessions L0 let go come back
from L1 with the tokens the uncached engine computes."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from test_l1_horizon import ARENA_SLOTS, BLOCK, assert_computed, restored_from_l1

from rank_worker.engine.interface import EngineStats
from rank_worker.l1.kvstore_link import KvStoreLink
from rank_worker.l1.slot_reserve import SlotReserve, reserved_slots_for


class CallsSeen(KvStoreLink):
    """The kvstore link, noting each Commit (write-through's say the pool holds the blocks; a save's names their
    hashes) and each Reserve."""

    commits: ClassVar[list[tuple[bool, int, bool]]] = []  # (gpu_holds, blocks, named hashes)
    reserves: ClassVar[list[tuple[int, int]]] = []  # (asked, given)

    def commit(
        self, arena_id: str, slots: list[int], *, gpu_holds: bool = False, block_hashes: list[bytes] | None = None
    ) -> None:
        CallsSeen.commits.append((gpu_holds, len(slots), bool(block_hashes)))
        super().commit(arena_id, slots, gpu_holds=gpu_holds, block_hashes=block_hashes)

    def reserve(self, arena_id: str, count: int) -> list[int]:
        slots = super().reserve(arena_id, count)
        CallsSeen.reserves.append((count, len(slots)))
        return slots


def run_sessions(
    tmp_path: Path, write_through: str, horizon_blocks: int = 8, **engine: object
) -> tuple[int, list[tuple[list[int], list[int]]], EngineStats]:
    CallsSeen.commits, CallsSeen.reserves = [], []
    return restored_from_l1(tmp_path, horizon_blocks, write_through, link_class=CallsSeen, engine_keys=engine)


def test_on_evict_writes_nothing_through_and_l1_keeps_what_l0_evicts(tmp_path: Path) -> None:
    always, _, _ = run_sessions(tmp_path / "always", "always")
    assert any(held for held, _, _ in CallsSeen.commits)  # write-through's commits say the pool holds the blocks
    # no horizon either (with one, its copies ahead of eviction took every block in this small run): L1 gets only
    # what the saves give it
    evicted, turns, stats = run_sessions(tmp_path / "on_evict", "on_evict", horizon_blocks=0)
    # nothing written through: every commit is a save, its hashes named, into slots a Reserve gave (a quarter of
    # the 24-slot arena: 6)
    assert CallsSeen.commits and all(named and not held for held, _, named in CallsSeen.commits), CallsSeen.commits
    assert CallsSeen.reserves and CallsSeen.reserves[0] == (ARENA_SLOTS // 4, ARENA_SLOTS // 4), CallsSeen.reserves
    # L1 holds what L0 does not: more of the evicted sessions come back than with write-through
    assert evicted >= always + 8 * BLOCK, (always, evicted)
    # what L0 evicted that L1 lacked went there but for bursts past the 6 slots in hand (5 of ~100 in runs alone)
    assert stats.l0_evicted_unsaved_blocks == stats.l0_evicted_unsaved_no_slot_blocks, stats
    assert stats.l0_evicted_unsaved_blocks * 5 < stats.l0_evicted_blocks, stats
    assert_computed(turns)  # the saved copies hold what was computed


def test_on_evict_without_reserved_slots_counts_each_lost_eviction(tmp_path: Path) -> None:
    """l1_reserved_slots 0: nothing in hand, so every eviction L1 lacks is lost, and counted as such."""
    _, turns, stats = run_sessions(tmp_path / "none", "on_evict", horizon_blocks=0, l1_reserved_slots=0)
    assert not CallsSeen.reserves and not any(named for _, _, named in CallsSeen.commits)
    assert 0 < stats.l0_evicted_unsaved_no_slot_blocks <= stats.l0_evicted_unsaved_blocks, stats
    assert_computed(turns)


def test_the_reservation_is_topped_up_at_half_and_renewed_when_due() -> None:
    reserve = SlotReserve(8, now=0.0, renew_interval_s=30.0)
    assert reserve.wanted(0.0) == 8  # empty: fill it
    reserve.asked(0.0, 8)
    assert reserve.wanted(1.0) is None  # one call at a time
    reserve.answered(list(range(8)))
    assert reserve.wanted(1.0) is None and len(reserve) == 8
    assert reserve.take(3) == [0, 1, 2] and reserve.wanted(2.0) is None  # 5 left: more than half
    assert reserve.take(1) == [3] and reserve.wanted(2.0) == 4  # half spent: top up
    reserve.asked(2.0, 4)
    reserve.answered([8, 9])  # the kvstore had fewer to give
    assert len(reserve) == 6 and reserve.take(3) == [4, 5, 6]  # 3 left: under half again
    assert reserve.wanted(2.5) is None  # after a short answer: no call for a second, not one a step ...
    assert reserve.wanted(3.1) == 5  # ... then the shortfall again
    reserve.asked(3.1, 5)
    reserve.answered([10, 11, 12, 13, 14])
    assert reserve.wanted(20.0) is None and reserve.wanted(33.1) == 0  # a renewal only, due every 30 s
    assert reserve.clear() == [7, 8, 9, 10, 11, 12, 13, 14] and len(reserve) == 0
    assert SlotReserve(0, now=0.0).wanted(100.0) is None  # no reservation: never a call
    assert reserved_slots_for(None, 32768, 16) == 4096 and reserved_slots_for(None, 4096, 16) == 1024
    assert reserved_slots_for(7, 32768, 16) == 7
