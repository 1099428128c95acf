"""The router's state and its operations, free of gRPC: ranks register and heartbeat, event feeds fill
the prefix index, Route scores the healthy ranks. The servicer calls these; tests call them directly.

Two outside effects are hooks: which ranks' KV event streams to follow (router/event_feeds.py) and which
keys changed for Redis (router/durable_state.py). Both are plain method calls that never block.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from contracts.kv_events import KvEvent
from router.prefix_index import PrefixIndex, PrefixMatch
from router.rank_registry import (
    ExpertParallelPlace,
    RankEntry,
    RankIdentity,
    RankLoad,
    RankRegistry,
    RegisterOutcome,
)
from router.route_score import Candidate, RouteChoice, RoutePolicy, choose_rank
from router.session_table import SessionTable
from router.session_view import SessionView

log = logging.getLogger("router")

# A rank down this long is forgotten (registry, index, Redis): rank ids of retired machines do not pile up.
FORGET_DOWN_RANK_AFTER_S = 600.0


def route_candidate(rank_id: str, entry: RankEntry, match: PrefixMatch) -> Candidate:
    """What the route score knows of one healthy rank: its prefix match and its load as the registry has it."""
    return Candidate(
        rank_id=rank_id,
        block_size=entry.identity.block_size,
        l0_blocks=match.l0_blocks,
        l1_blocks=match.l1_blocks,
        queued_prefill_tokens=entry.queued_prefill_tokens,
        running=entry.load.running,
        queued_warm_prefill_tokens=entry.queued_warm_prefill_tokens,
    )


class RankFollower(Protocol):
    """Keeps one KV event subscription per followed rank."""

    def follow_rank(self, identity: RankIdentity) -> None:
        """(Re)subscribe to this rank's events; a previous subscription for the rank id is replaced."""

    def unfollow_rank(self, rank_id: str) -> None:
        """Stop the rank's subscription, if any."""


class DurableChanges(Protocol):
    """Told which durable keys changed; writes them to Redis later, never in the caller's path."""

    def session_changed(self, session_id: str) -> None: ...

    def rank_changed(self, rank_id: str) -> None: ...

    def rank_forgotten(self, rank_id: str) -> None: ...


class _NoFollower:
    def follow_rank(self, identity: RankIdentity) -> None:
        pass

    def unfollow_rank(self, rank_id: str) -> None:
        pass


class _NoDurability:
    def session_changed(self, session_id: str) -> None:
        pass

    def rank_changed(self, rank_id: str) -> None:
        pass

    def rank_forgotten(self, rank_id: str) -> None:
        pass


class NoRankAvailableError(Exception):
    """No healthy rank outside the request's avoid list."""


@dataclass(frozen=True)
class RouteQuery:
    """A checked router.proto RouteRequest (router/servicer.py converts it; the gateway sends the message)."""

    request_id: str
    session_id: str  # empty: no stickiness
    block_hashes: Sequence[bytes]
    prompt_tokens: int
    avoid_rank_ids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RouteAnswer:
    choice: RouteChoice
    address: str


class RouterState:
    """Registry + prefix index + session table, and the decisions made from them."""

    def __init__(
        self,
        policy: RoutePolicy,
        session_ttl_s: float,
        rank_down_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.registry = RankRegistry(rank_down_after_s)
        self.index = PrefixIndex()
        self.sessions = SessionTable(session_ttl_s)
        # The per-session view (ReportFinished, ListSessions): memory only, never read for routing.
        self.session_view = SessionView(policy.warm_prefix_fraction)
        self.follower: RankFollower = _NoFollower()
        self.durable: DurableChanges = _NoDurability()
        self._clock = clock
        # For the metrics: routing decisions by reason (route_score's), and session turns by whether they
        # stayed on the session's rank ("sticky"), left it ("moved") or had none to stay on ("new").
        self.decisions: collections.Counter[str] = collections.Counter()
        self.session_turns: collections.Counter[str] = collections.Counter()

    # --- ranks ---

    def register_rank(
        self, identity: RankIdentity, load: RankLoad, expert_parallel: ExpertParallelPlace | None = None
    ) -> RegisterOutcome:
        """A rank (re)announces itself: healthy now; a new incarnation starts with an empty index."""
        previous = self.registry.get(identity.rank_id)
        outcome = self.registry.register(identity, load, self._clock(), expert_parallel)
        if outcome is not RegisterOutcome.SAME_INCARNATION:
            self.index.clear_rank(identity.rank_id)
        if previous is None or previous.identity != identity:
            self.durable.rank_changed(identity.rank_id)
        # A fresh subscription starts with a snapshot, so the index is right whatever happened before.
        self.follower.follow_rank(identity)
        log.info(
            "rank %s registered (%s) at %s, incarnation %s, block size %d%s",
            identity.rank_id,
            outcome.value,
            identity.address,
            identity.incarnation,
            identity.block_size,
            _describe_group(expert_parallel),
        )
        return outcome

    def restore_rank(self, identity: RankIdentity) -> None:
        """A rank read back from Redis at start: follow its events, route to it once it heartbeats."""
        if self.registry.get(identity.rank_id) is not None:
            return
        self.registry.restore(identity, self._clock())
        self.follower.follow_rank(identity)

    def heartbeat(
        self, rank_id: str, incarnation: str, load: RankLoad, expert_parallel: ExpertParallelPlace | None = None
    ) -> bool:
        """False: the router does not know this process (or declared it down); it must register again."""
        entry = self.registry.get(rank_id)
        was_unconfirmed = entry is not None and not entry.healthy
        previous_group = entry.expert_parallel if entry is not None else None
        known = self.registry.heartbeat(rank_id, incarnation, load, self._clock(), expert_parallel)
        if known and was_unconfirmed:
            log.info(
                "rank %s confirmed by its heartbeat (known from Redis)%s", rank_id, _describe_group(expert_parallel)
            )
        elif known and expert_parallel != previous_group:
            log.info("rank %s now reports%s", rank_id, _describe_group(expert_parallel) or " no expert-parallel group")
        return known

    def report_failure(self, rank_id: str, detail: str, request_id: str = "") -> bool:
        """A client saw the rank fail (serving `request_id`): take it out now. False if unknown or already down."""
        reason = f"reported failed by request={request_id}" if request_id else "reported failed"
        return self._mark_down(rank_id, f"{reason}: {detail}" if detail else reason)

    def feed_lost(self, rank_id: str, incarnation: str, detail: str) -> None:
        """The rank's event stream has been unreachable for rank_down_after_secs: it is most likely dead."""
        self._mark_down(rank_id, f"event stream lost: {detail}", incarnation)

    def apply_rank_events(self, rank_id: str, incarnation: str, events: Iterable[KvEvent]) -> None:
        entry = self.registry.get(rank_id)
        if entry is not None and entry.identity.incarnation == incarnation:
            self.index.apply(rank_id, events)

    def reset_rank_events(self, rank_id: str, incarnation: str) -> None:
        """A new subscription: what we held for the rank is replaced by the snapshot that follows."""
        entry = self.registry.get(rank_id)
        if entry is not None and entry.identity.incarnation == incarnation:
            self.index.clear_rank(rank_id)

    def sweep(self) -> None:
        """Periodic: ranks silent too long go down, long-down ranks are forgotten, idle sessions expire."""
        now = self._clock()
        for entry in self.registry.stale(now):
            silent_s = now - entry.last_heartbeat
            self._mark_down(entry.rank_id, f"no heartbeat for {silent_s:.1f}s")
        for entry in self.registry.down_longer_than(FORGET_DOWN_RANK_AFTER_S, now):
            self.registry.forget(entry.rank_id)
            self.index.clear_rank(entry.rank_id)
            self.follower.unfollow_rank(entry.rank_id)
            self.durable.rank_forgotten(entry.rank_id)
            log.info("rank %s forgotten after %.0fs down", entry.rank_id, FORGET_DOWN_RANK_AFTER_S)
        self.sessions.purge_expired(now)

    def _mark_down(self, rank_id: str, reason: str, incarnation: str | None = None) -> bool:
        if not self.registry.mark_down(rank_id, reason, self._clock(), incarnation):
            return False
        self.follower.unfollow_rank(rank_id)
        self.index.clear_rank(rank_id)  # a rank back from down re-registers and resends a snapshot
        log.warning("rank %s marked down: %s", rank_id, reason)
        return True

    # --- routing ---

    def route(self, query: RouteQuery) -> RouteAnswer:
        """Choose a rank, remember it for the session, count the new prefill against its load."""
        now = self._clock()
        ranks = {entry.rank_id: entry for entry in self.registry.healthy() if entry.rank_id not in query.avoid_rank_ids}
        if not ranks:
            detail = f"no healthy rank to route to ({len(self.registry)} known, {len(query.avoid_rank_ids)} avoided)"
            log.warning("route request=%s: %s", query.request_id or "-", detail)
            raise NoRankAvailableError(detail)
        matches = self.index.match(query.block_hashes, ranks)
        candidates = [route_candidate(rank_id, entry, matches[rank_id]) for rank_id, entry in ranks.items()]
        session_rank = self.sessions.rank_of(query.session_id, now) if query.session_id else None
        choice = choose_rank(candidates, query.prompt_tokens, session_rank, self.policy)
        assert choice is not None  # candidates is not empty
        self.registry.add_pending_prefill(choice.rank_id, choice.new_prefill_tokens, choice.warm)
        self.decisions[choice.reason] += 1
        if query.session_id:
            self.session_turns[session_turn(session_rank, choice.rank_id)] += 1
            self.sessions.record(query.session_id, choice.rank_id, now)
            self.durable.session_changed(query.session_id)
        log.info(
            "route request=%s session=%s rank=%s reason=%s prompt=%d l0=%d l1=%d score=%.0f candidates=%d",
            query.request_id or "-",
            query.session_id or "-",
            choice.rank_id,
            choice.reason,
            query.prompt_tokens,
            choice.expected_l0_tokens,
            choice.expected_l1_tokens,
            choice.score,
            len(candidates),
        )
        return RouteAnswer(choice, ranks[choice.rank_id].identity.address)

    # --- status ---

    def now(self) -> float:
        """The state's clock (monotonic seconds)."""
        return self._clock()

    def ranks(self) -> list[RankEntry]:
        return sorted(self.registry, key=lambda entry: entry.rank_id)

    def heartbeat_age(self, entry: RankEntry) -> float:
        return max(self._clock() - entry.last_heartbeat, 0.0)


def session_turn(session_rank: str | None, chosen: str) -> str:
    """A session's turn as the metrics count it: sticky (its last rank again), moved (another), new (none known)."""
    if session_rank is None:
        return "new"
    return "sticky" if chosen == session_rank else "moved"


def _describe_group(place: ExpertParallelPlace | None) -> str:
    """The log's words for a rank's expert-parallel group: empty for none."""
    return "" if place is None else f", expert-parallel group {place.group} rank {place.rank}/{place.size}"
