"""The router in the simulator: router/prefix_index.py fed with the simulated ranks' KV events and the node
cache's changes, and router/route_score.py's choose_rank over them, with each rank's queue as the load.

The real router learns about a rank's queue from heartbeats and adds what it routed there since; here the
rank's state is read directly (the most current a router could be).
"""

from __future__ import annotations

from collections.abc import Sequence

from contracts.kv_events import KvEvent, KvEventKind
from router.prefix_index import PrefixIndex
from router.route_score import Candidate, RoutePolicy, choose_rank
from simulator.host_cache import NodeHostCache
from simulator.sim_rank import ReplayRank


class SimulatedRouter:
    def __init__(self, ranks: Sequence[ReplayRank], policy: RoutePolicy, node_cache: NodeHostCache | None) -> None:
        self.ranks = {rank.rank_id: rank for rank in ranks}
        self.policy = policy
        self.node_cache = node_cache
        self.index = PrefixIndex()
        self.sessions: dict[str, str] = {}  # session id -> the rank of its last turn
        self.reasons: dict[str, int] = {}

    def rank_events(self, rank_id: str, events: list[KvEvent]) -> None:
        if len(self.ranks) == 1:
            return  # one rank needs no index
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
        if len(self.ranks) == 1:
            return next(iter(self.ranks.values()))
        self.sync_l1()
        matches = self.index.match(lookup_hashes, list(self.ranks))
        candidates = [
            Candidate(
                rank_id=rank_id,
                block_size=rank.settings.block_size,
                l0_blocks=matches[rank_id].l0_blocks,
                l1_blocks=matches[rank_id].l1_blocks,
                queued_prefill_tokens=rank.scheduler.waiting_prefill_tokens(),
                running=len(rank.scheduler.running),
                queued_warm_prefill_tokens=rank.scheduler.waiting_warm_prefill_tokens(),
            )
            for rank_id, rank in self.ranks.items()
        ]
        choice = choose_rank(candidates, prompt_tokens, self.sessions.get(session_id), self.policy)
        assert choice is not None  # there is always a candidate
        self.sessions[session_id] = choice.rank_id
        self.reasons[choice.reason] = self.reasons.get(choice.reason, 0) + 1
        return self.ranks[choice.rank_id]
