"""The ranks the router knows: where they are, which process (incarnation) they are, their load and health.

A rank is HEALTHY while it heartbeats, DOWN once it misses heartbeats for rank_down_after_secs or someone
reports it failed, and UNCONFIRMED when it was loaded from Redis at router start and has not spoken yet.

A rank of an expert-parallel group says which (and its place in it) when it registers and in every heartbeat; the
registry keeps what it last said, for the status listing. Routing does not look at it: each rank of a group keeps
its own sessions and KV pool.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankLoad:
    """What a rank last reported about its queues and KV pool."""

    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    waiting_warm_prefill_tokens: int = 0  # the part of waiting_prefill_tokens a new warm request waits for


@dataclass(frozen=True)
class ExpertParallelPlace:
    """A rank's place in its expert-parallel group, as the rank reports it."""

    group: str  # the group's name, e.g. ep-0
    rank: int  # its place in the group, 0..size-1
    size: int  # ranks in the group


class RankHealth(enum.Enum):
    HEALTHY = "healthy"
    UNCONFIRMED = "unconfirmed"  # restored from Redis, not heard from since this router started
    DOWN = "down"


@dataclass(frozen=True)
class RankIdentity:
    """The durable part of a rank: what Redis keeps across router restarts."""

    rank_id: str
    address: str
    incarnation: str
    block_size: int
    hash_namespace: bytes


@dataclass
class RankEntry:
    identity: RankIdentity
    health: RankHealth
    last_heartbeat: float  # monotonic seconds; for UNCONFIRMED ranks: when they were loaded
    load: RankLoad = field(default_factory=RankLoad)
    # Prefill routed here since the last heartbeat (each request's new_prefill: uncached tokens, the unit of the
    # rank's report): the rank's queue will hold it before it says so.
    pending_prefill_tokens: int = 0
    pending_warm_prefill_tokens: int = 0  # the part of it routed as warm requests
    down_since: float | None = None
    down_reason: str = ""
    expert_parallel: ExpertParallelPlace | None = None  # as last reported; None: in no group

    @property
    def rank_id(self) -> str:
        return self.identity.rank_id

    @property
    def healthy(self) -> bool:
        return self.health is RankHealth.HEALTHY

    @property
    def queued_prefill_tokens(self) -> int:
        """Prefill work ahead of a new request: what the rank reported plus what we sent it since."""
        return self.load.waiting_prefill_tokens + self.pending_prefill_tokens

    @property
    def queued_warm_prefill_tokens(self) -> int:
        """The part of queued_prefill_tokens a new warm request queues behind."""
        return self.load.waiting_warm_prefill_tokens + self.pending_warm_prefill_tokens


class RegisterOutcome(enum.Enum):
    NEW = "new"
    NEW_INCARNATION = "new-incarnation"  # a restarted process: everything it held before is gone
    SAME_INCARNATION = "same-incarnation"


class RankRegistry:
    """All known ranks by id. Time is passed in (monotonic seconds) so tests drive it."""

    def __init__(self, rank_down_after_s: float) -> None:
        self.rank_down_after_s = rank_down_after_s
        self._ranks: dict[str, RankEntry] = {}

    def __len__(self) -> int:
        return len(self._ranks)

    def __iter__(self) -> Iterator[RankEntry]:
        return iter(list(self._ranks.values()))

    def get(self, rank_id: str) -> RankEntry | None:
        return self._ranks.get(rank_id)

    def register(
        self, identity: RankIdentity, load: RankLoad, now: float, expert_parallel: ExpertParallelPlace | None = None
    ) -> RegisterOutcome:
        """A rank announces itself (and its expert-parallel group, if any); it is healthy from now on. A new
        incarnation replaces the old entry."""
        previous = self._ranks.get(identity.rank_id)
        if previous is None:
            outcome = RegisterOutcome.NEW
        elif previous.identity.incarnation != identity.incarnation:
            outcome = RegisterOutcome.NEW_INCARNATION
        else:
            outcome = RegisterOutcome.SAME_INCARNATION
        self._ranks[identity.rank_id] = RankEntry(
            identity, RankHealth.HEALTHY, now, load, expert_parallel=expert_parallel
        )
        return outcome

    def restore(self, identity: RankIdentity, now: float) -> None:
        """A rank remembered from before a router restart: not routable until it heartbeats."""
        if identity.rank_id not in self._ranks:
            self._ranks[identity.rank_id] = RankEntry(identity, RankHealth.UNCONFIRMED, now)

    def heartbeat(
        self,
        rank_id: str,
        incarnation: str,
        load: RankLoad,
        now: float,
        expert_parallel: ExpertParallelPlace | None = None,
    ) -> bool:
        """Record a heartbeat and the group it reports (None: in no group); False (the rank must register again)
        for an unknown rank, another incarnation, or a rank declared down: a down rank comes back only through
        RegisterRank."""
        entry = self._ranks.get(rank_id)
        if entry is None or entry.identity.incarnation != incarnation or entry.health is RankHealth.DOWN:
            return False
        entry.health = RankHealth.HEALTHY
        entry.last_heartbeat = now
        entry.load = load
        entry.expert_parallel = expert_parallel
        entry.pending_prefill_tokens = 0  # the reported queue now includes what we sent before
        entry.pending_warm_prefill_tokens = 0
        return True

    def mark_down(self, rank_id: str, reason: str, now: float, incarnation: str | None = None) -> bool:
        """Take a rank out of routing; True if it was not down already. With `incarnation`, only that
        process is meant (a late report about an old process must not take down its successor)."""
        entry = self._ranks.get(rank_id)
        if entry is None or entry.health is RankHealth.DOWN:
            return False
        if incarnation is not None and entry.identity.incarnation != incarnation:
            return False
        entry.health = RankHealth.DOWN
        entry.down_since = now
        entry.down_reason = reason
        entry.pending_prefill_tokens = 0
        entry.pending_warm_prefill_tokens = 0
        return True

    def stale(self, now: float) -> list[RankEntry]:
        """Ranks not down yet whose last heartbeat is older than rank_down_after_s."""
        return [
            entry
            for entry in self._ranks.values()
            if entry.health is not RankHealth.DOWN and now - entry.last_heartbeat > self.rank_down_after_s
        ]

    def down_longer_than(self, seconds: float, now: float) -> list[RankEntry]:
        return [
            entry
            for entry in self._ranks.values()
            if entry.down_since is not None and entry.health is RankHealth.DOWN and now - entry.down_since > seconds
        ]

    def forget(self, rank_id: str) -> None:
        self._ranks.pop(rank_id, None)

    def add_pending_prefill(self, rank_id: str, tokens: int, warm: bool = False) -> None:
        """Optimistic load: a request routed here will queue `tokens` of prefill before the next heartbeat
        (`warm`: as a warm request, ahead of the cold ones)."""
        entry = self._ranks.get(rank_id)
        if entry is not None:
            entry.pending_prefill_tokens += max(tokens, 0)
            if warm:
                entry.pending_warm_prefill_tokens += max(tokens, 0)

    def healthy(self) -> list[RankEntry]:
        return [entry for entry in self._ranks.values() if entry.healthy]
