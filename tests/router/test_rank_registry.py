"""The rank registry: registration, incarnations, heartbeats, down ranks, optimistic load and the expert-parallel
group a rank reports."""

from __future__ import annotations

import pytest

from protos import router_pb2 as pb
from router.rank_registry import (
    ExpertParallelPlace,
    RankHealth,
    RankIdentity,
    RankLoad,
    RankRegistry,
    RegisterOutcome,
)
from router.servicer import InvalidMessageError, expert_parallel_message, expert_parallel_place


def identity(rank_id: str = "r0", incarnation: str = "i1", address: str = "127.0.0.1:1") -> RankIdentity:
    return RankIdentity(rank_id, address, incarnation, 16, b"\x01" * 16)


def test_register_new_then_same_then_new_incarnation() -> None:
    registry = RankRegistry(rank_down_after_s=5)
    assert registry.register(identity(), RankLoad(), now=0) is RegisterOutcome.NEW
    assert registry.register(identity(), RankLoad(), now=1) is RegisterOutcome.SAME_INCARNATION
    assert registry.register(identity(incarnation="i2"), RankLoad(), now=2) is RegisterOutcome.NEW_INCARNATION
    entry = registry.get("r0")
    assert entry is not None and entry.healthy and entry.identity.incarnation == "i2"
    assert len(registry) == 1


def test_heartbeat_known_only_for_the_registered_incarnation() -> None:
    registry = RankRegistry(rank_down_after_s=5)
    assert not registry.heartbeat("r0", "i1", RankLoad(), now=0), "unknown rank must register"
    registry.register(identity(), RankLoad(), now=0)
    assert registry.heartbeat("r0", "i1", RankLoad(running=3), now=1)
    assert not registry.heartbeat("r0", "old", RankLoad(), now=1), "another process with the same id"
    entry = registry.get("r0")
    assert entry is not None and entry.load.running == 3 and entry.last_heartbeat == 1


def test_down_rank_must_register_again_even_with_the_same_incarnation() -> None:
    registry = RankRegistry(rank_down_after_s=5)
    registry.register(identity(), RankLoad(), now=0)
    assert registry.mark_down("r0", "reported", now=1)
    assert not registry.mark_down("r0", "again", now=1), "already down"
    assert not registry.heartbeat("r0", "i1", RankLoad(), now=2)
    assert registry.healthy() == []
    registry.register(identity(), RankLoad(), now=3)
    assert registry.heartbeat("r0", "i1", RankLoad(), now=4)


def test_mark_down_for_an_old_incarnation_leaves_its_successor_alone() -> None:
    registry = RankRegistry(rank_down_after_s=5)
    registry.register(identity(incarnation="new"), RankLoad(), now=0)
    assert not registry.mark_down("r0", "old stream lost", now=1, incarnation="old")
    assert [entry.rank_id for entry in registry.healthy()] == ["r0"]


def test_stale_ranks_are_the_ones_silent_past_the_deadline() -> None:
    registry = RankRegistry(rank_down_after_s=5)
    registry.register(identity("a"), RankLoad(), now=0)
    registry.register(identity("b"), RankLoad(), now=0)
    registry.heartbeat("b", "i1", RankLoad(), now=4)
    assert [entry.rank_id for entry in registry.stale(now=5.5)] == ["a"]


def test_restored_rank_is_unconfirmed_until_it_heartbeats() -> None:
    registry = RankRegistry(rank_down_after_s=5)
    registry.restore(identity(), now=0)
    entry = registry.get("r0")
    assert entry is not None and entry.health is RankHealth.UNCONFIRMED and registry.healthy() == []
    assert registry.heartbeat("r0", "i1", RankLoad(), now=1)
    assert entry.health is RankHealth.HEALTHY
    registry.restore(identity(incarnation="other"), now=2)
    assert entry.identity.incarnation == "i1", "restore never overwrites a live entry"


def test_optimistic_pending_prefill_until_the_next_heartbeat() -> None:
    registry = RankRegistry(rank_down_after_s=5)
    registry.register(identity(), RankLoad(waiting_prefill_tokens=100), now=0)
    registry.add_pending_prefill("r0", 1000)
    registry.add_pending_prefill("r0", 500)
    entry = registry.get("r0")
    assert entry is not None and entry.queued_prefill_tokens == 1600
    registry.heartbeat("r0", "i1", RankLoad(waiting_prefill_tokens=1400), now=1)
    assert entry.queued_prefill_tokens == 1400, "the heartbeat's queue replaces the estimate"


def test_pending_warm_prefill_counts_in_the_warm_queue_only_when_routed_warm() -> None:
    registry = RankRegistry(rank_down_after_s=5)
    registry.register(identity(), RankLoad(waiting_prefill_tokens=900, waiting_warm_prefill_tokens=100), now=0)
    registry.add_pending_prefill("r0", 1000)  # a cold request
    registry.add_pending_prefill("r0", 50, warm=True)
    entry = registry.get("r0")
    assert entry is not None and (entry.queued_prefill_tokens, entry.queued_warm_prefill_tokens) == (1950, 150)
    registry.heartbeat("r0", "i1", RankLoad(waiting_prefill_tokens=1400, waiting_warm_prefill_tokens=30), now=1)
    assert (entry.queued_prefill_tokens, entry.queued_warm_prefill_tokens) == (1400, 30)


def test_the_group_a_rank_reports_is_kept_from_its_heartbeats() -> None:
    registry = RankRegistry(rank_down_after_s=5)
    place = ExpertParallelPlace("ep-2", 1, 2)
    registry.register(identity("r3"), RankLoad(), now=0, expert_parallel=place)
    entry = registry.get("r3")
    assert entry is not None and entry.expert_parallel == place
    assert registry.heartbeat("r3", "i1", RankLoad(running=1), now=1, expert_parallel=place)
    assert entry.expert_parallel == place and entry.load.running == 1
    # a rank known from Redis alone (the router restarted) learns its group from the next heartbeat
    registry.restore(identity("r4"), now=0)
    restored = registry.get("r4")
    assert restored is not None and restored.expert_parallel is None
    assert registry.heartbeat("r4", "i1", RankLoad(), now=1, expert_parallel=ExpertParallelPlace("ep-4", 0, 2))
    assert restored.expert_parallel == ExpertParallelPlace("ep-4", 0, 2) and restored.healthy
    # what the rank last said counts: a heartbeat without a group means none
    assert registry.heartbeat("r3", "i1", RankLoad(), now=2)
    assert entry.expert_parallel is None
    assert not registry.heartbeat("r3", "stale", RankLoad(), now=3, expert_parallel=place), "another process"
    assert entry.expert_parallel is None


def test_the_wire_group_place() -> None:
    place = pb.ExpertParallelPlace(group="ep-0", rank=1, size=2)
    assert expert_parallel_place(place) == ExpertParallelPlace("ep-0", 1, 2)
    assert expert_parallel_message(ExpertParallelPlace("ep-0", 1, 2)) == place
    assert expert_parallel_place(pb.HeartbeatRequest().expert_parallel) is None  # unset: in no group
    assert expert_parallel_place(pb.ExpertParallelPlace(rank=0, size=2)) is None  # no name: in no group
    assert expert_parallel_message(None) is None
    for bad in (pb.ExpertParallelPlace(group="ep-0", rank=2, size=2), pb.ExpertParallelPlace(group="ep-0", size=0)):
        with pytest.raises(InvalidMessageError, match="0 <= rank < size"):
            expert_parallel_place(bad)
    with pytest.raises(InvalidMessageError, match="unprintable"):
        expert_parallel_place(pb.ExpertParallelPlace(group="ep\n0", rank=0, size=1))
