"""The router in the simulator: router/prefix_index.py fed with the simulated ranks' KV events and the node
cache's changes, router/rank_registry.py holding each rank's load as its heartbeats report it plus what was
routed there since, and router/route_score.py's choose_rank over them.

As in the real router, a rank's load is what its last heartbeat said (the replay sends one from every rank each
heartbeat interval; the scheduler's own measurement may be up to 0.5 s older), and each request routed since
adds its expected prefill until the next one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from contracts.kv_events import KvEvent, KvEventKind
from router.prefix_index import PrefixIndex
from router.rank_registry import RankIdentity, RankLoad, RankRegistry
from router.route_score import RoutePolicy, choose_rank
from router.router_state import route_candidate
from simulator.host_cache import NodeHostCache
from simulator.sim_rank import ReplayRank

INCARNATION = "simulated"


def rank_load(rank: ReplayRank) -> RankLoad:
    """What the rank's router link would send (rank_worker/router_link.py from PagedEngine.stats)."""
    scheduler = rank.scheduler
    return RankLoad(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        waiting_prefill_tokens=scheduler.waiting_prefill_tokens(),
        free_blocks=rank.kv.pool.num_free,
        total_blocks=rank.kv.pool.num_blocks,
        waiting_warm_prefill_tokens=scheduler.waiting_warm_prefill_tokens(),
    )


class SimulatedRouter:
    def __init__(
        self,
        ranks: Sequence[ReplayRank],
        policy: RoutePolicy,
        node_cache: NodeHostCache | None,
        clock: Callable[[], float],
    ) -> None:
        self.ranks = {rank.rank_id: rank for rank in ranks}
        self.policy = policy
        self.node_cache = node_cache
        self.clock = clock
        self.index = PrefixIndex()
        self.registry = RankRegistry(rank_down_after_s=math.inf)  # simulated ranks never go down
        for rank in ranks:
            identity = RankIdentity(rank.rank_id, rank.rank_id, INCARNATION, rank.settings.engine.block_size, b"")
            self.registry.register(identity, RankLoad(), clock())
        self.sessions: dict[str, str] = {}  # session id -> the rank of its last turn
        self.reasons: dict[str, int] = {}

    @property
    def needed(self) -> bool:
        """One rank needs no routing (no index, no heartbeats)."""
        return len(self.ranks) > 1

    def heartbeat(self) -> None:
        """Every rank reports its load, as its router link does once a heartbeat interval."""
        now = self.clock()
        for rank_id, rank in self.ranks.items():
            self.registry.heartbeat(rank_id, INCARNATION, rank_load(rank), now)

    def rank_events(self, rank_id: str, events: list[KvEvent]) -> None:
        if self.needed:
            self.index.apply(rank_id, events)

    def sync_l1(self) -> None:
        if self.node_cache is None:
            return
        stored, removed = self.node_cache.drain()
        if stored:
            self.index.apply_l1([KvEvent(KvEventKind.STORED, tuple(stored))])
        if removed:
            self.index.apply_l1([KvEvent(KvEventKind.REMOVED, tuple(removed))])

    def route(self, session_id: str, lookup_hashes: list[bytes], prompt_tokens: int) -> ReplayRank:
        """The rank for one request (and remember it as the session's)."""
        if not self.needed:
            return next(iter(self.ranks.values()))
        self.sync_l1()
        matches = self.index.match(lookup_hashes, list(self.ranks))
        candidates = []
        for rank_id in self.ranks:
            entry = self.registry.get(rank_id)
            assert entry is not None  # registered at start, never forgotten
            candidates.append(route_candidate(rank_id, entry, matches[rank_id]))
        choice = choose_rank(candidates, prompt_tokens, self.sessions.get(session_id), self.policy)
        assert choice is not None  # there is always a candidate
        self.registry.add_pending_prefill(choice.rank_id, choice.new_prefill_tokens, choice.warm)
        self.sessions[session_id] = choice.rank_id
        self.reasons[choice.reason] = self.reasons.get(choice.reason, 0) + 1
        return self.ranks[choice.rank_id]
