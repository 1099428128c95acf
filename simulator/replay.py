"""One step of N agents replayed on a simulated node: the agents of the load generator (same session assignment,
think times, turn budget and deadline, warm/cold judgement and request records), the router's choice of
rank, and R simulated ranks running the real scheduler and cache code on a simulated clock.

A discrete-event loop: the next thing to happen is either an agent's call (at its start, or after its
think time), the end of a busy rank's current step, or (with several ranks) the ranks' heartbeats to the
router, whichever is earliest (heartbeats, then calls, on a tie, so a call that arrives as a step ends joins
the next step). A rank steps back to back while it has work.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from contracts.block_hash import hash_namespace
from contracts.config import DEFAULTS
from loadgen.agent import WARM_REUSE, RequestRecord, ThinkTime
from loadgen.reuse import SentPrefixes
from loadgen.runner import assigned_sessions
from loadgen.traces import AgentTrace, TraceTurn
from rank_worker.engine.interface import SamplingParams
from rank_worker.engine.sequence import Sequence
from router.route_score import RoutePolicy
from simulator.host_cache import NodeHostCache
from simulator.prompt_tokens import PromptTokens
from simulator.routing import SimulatedRouter
from simulator.sim_rank import RankSettings, ReplayRank, SimulatedRank
from simulator.step_time import StepTimeModel


@dataclass(frozen=True)
class WorkloadSettings:
    """What the load generator's flags say about a step (the same names as loadgen's RunSettings/StepSettings)."""

    agents: int
    turns: int | None = None  # calls per agent
    duration_s: float | None = None  # no call starts after this; calls in flight finish
    stagger_s: float = 0.0  # agent starts spread over this many seconds
    think: ThinkTime = field(default_factory=ThinkTime)
    context_scale: float = 1.0
    max_context: int = 131072  # the served context (max_tokens is clamped to the room it leaves)
    max_output_tokens: int | None = None
    seed: int = 0
    step_index: int = 0


@dataclass(frozen=True)
class NodeSettings:
    ranks: int
    rank: RankSettings
    l1_blocks: int = 0  # the node's host cache in blocks; 0 = no L1
    route: RoutePolicy = field(
        default_factory=lambda: RoutePolicy(
            l1_restore_cost=DEFAULTS.scheduling.l1_restore_cost,
            overload_prefill_tokens=DEFAULTS.overload_prefill_tokens,
        )
    )
    model_id: str = "simulated"
    heartbeat_interval_s: float = DEFAULTS.heartbeat_interval_secs  # how often ranks report their load


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    cached_by_tier: dict[str, float]  # l0 / l1 cached tokens, as the gateway's counters would say
    wall_s: float  # simulated seconds from the step's start to its last answer
    rank_busy_s: list[float]
    rank_steps: list[int]
    route_reasons: dict[str, int]
    l1_cached_by_call: list[int] = field(default_factory=list)  # of each record's cached tokens, L1's (same order)
    rank_l1_blocks: list[dict[str, int]] = field(default_factory=list)  # each rank's host tier's block counters


@dataclass
class _Agent:
    index: int
    sessions: Iterator[tuple[AgentTrace, str]]
    session: AgentTrace | None = None
    session_id: str = ""
    session_turn: int = 0
    turns_done: int = 0
    previous: Sequence | None = None  # its last call, whose lookup hashes the next one may start from

    def next_turn(self) -> TraceTurn:
        while self.session is None or self.session_turn >= len(self.session.turns):
            self.session, self.session_id = next(self.sessions)
            self.session_turn = 0
        return self.session.turns[self.session_turn]


@dataclass
class _Call:
    agent: _Agent
    seq: Sequence
    turn: TraceTurn
    sent_s: float
    reuse: float
    max_tokens: int


class Replay:
    def __init__(
        self,
        sessions: list[AgentTrace],
        workload: WorkloadSettings,
        node: NodeSettings,
        step_time: StepTimeModel,
        make_rank: Callable[[int, Callable[[], float]], ReplayRank] | None = None,
    ) -> None:
        """make_rank(index, clock): rank `index` of the node (default: a SimulatedRank; engine_check.py
        passes ranks that run the real engine on a GPU and time it)."""
        if workload.duration_s is None and workload.turns is None:
            raise ValueError("a step needs a duration or a turn budget")
        self.workload = workload
        self.node = node
        self.now = 0.0
        self.deadline = workload.duration_s if workload.duration_s is not None else math.inf
        block_size = node.rank.engine.block_size
        self.namespace = hash_namespace(node.model_id, "simulated", block_size)
        # One sequence must fit a rank's pool, as the factory lowers max_model_len to the pool's capacity.
        self.max_model_len = min(node.rank.max_model_len, node.rank.num_blocks * block_size)
        self.ranks, self.router = self._build_ranks(step_time, make_rank)
        self._next_heartbeat = 0.0 if self.router.needed else math.inf
        self.prompts = PromptTokens(workload.context_scale)
        self.sent = SentPrefixes()
        self.records: list[RequestRecord] = []
        self._l1_by_record: dict[int, int] = {}  # id(record) -> its L1 tokens
        self._l1_tokens = 0
        self.calls: dict[str, _Call] = {}
        self._events: list[tuple[float, int, _Agent]] = []  # (time, tie-breaker, agent to wake)
        self._order = itertools.count()
        self._request_ids = itertools.count()
        agents = workload.agents
        for index in range(agents):
            agent = _Agent(index, assigned_sessions(sessions, agents, index, workload.step_index, workload.seed))
            self._wake(agent, workload.stagger_s * index / max(1, agents), 0.0)

    def _build_ranks(
        self, step_time: StepTimeModel, make_rank: Callable[[int, Callable[[], float]], ReplayRank] | None
    ) -> tuple[list[ReplayRank], SimulatedRouter]:
        """The ranks and what routes calls to them: one node's (simulator/nodes.py builds a fleet of nodes)."""
        node = self.node
        self.node_cache = NodeHostCache(node.l1_blocks) if node.l1_blocks > 0 else None
        if make_rank is None:

            def make_rank(index: int, clock: Callable[[], float]) -> ReplayRank:
                return SimulatedRank(f"rank-{index}", node.rank, self.namespace, step_time, clock, self.node_cache)

        ranks = [make_rank(i, self.clock) for i in range(node.ranks)]  # the schedulers' clock is the replay's
        return ranks, SimulatedRouter(ranks, node.route, self.node_cache, self.clock)

    def clock(self) -> float:
        return self.now

    def run(self) -> ReplayResult:
        last_answer = 0.0
        while True:
            next_call = self._events[0][0] if self._events else math.inf
            busy = [rank for rank in self.ranks if rank.has_work]
            rank = min(busy, key=lambda r: r.busy_until, default=None)
            next_step = rank.busy_until if rank is not None else math.inf
            if next_call == math.inf and next_step == math.inf:
                break
            if self._next_heartbeat <= min(next_call, next_step):
                self.now = self._next_heartbeat
                self.router.heartbeat()
                self._next_heartbeat += self.node.heartbeat_interval_s
                continue
            if next_call <= next_step:
                self.now, _, agent = heapq.heappop(self._events)
                self._call(agent)
                continue
            assert rank is not None
            self.now = next_step
            outcome = rank.step(self.now)
            self.router.rank_events(rank.rank_id, outcome.events)
            for seq in outcome.finished:
                call = self.calls.pop(seq.request_id)
                self._record(call, seq)
                last_answer = max(last_answer, outcome.end)
                self._after_call(call.agent, outcome.end)
        self.records.sort(key=lambda record: record.sent_s)
        l0 = sum(record.cached_tokens for record in self.records) - self._l1_tokens
        return ReplayResult(
            records=self.records,
            l1_cached_by_call=[self._l1_by_record[id(record)] for record in self.records],
            cached_by_tier={"l0": float(l0), "l1": float(self._l1_tokens)},
            wall_s=last_answer,
            rank_busy_s=[rank.busy_s for rank in self.ranks],
            rank_steps=[rank.steps for rank in self.ranks],
            route_reasons=dict(self.router.reasons),
            rank_l1_blocks=[rank.tier.block_counts() if rank.tier is not None else {} for rank in self.ranks],
        )

    # --- agents ---

    def _done(self, agent: _Agent, now: float) -> bool:
        turns = self.workload.turns
        return (turns is not None and agent.turns_done >= turns) or now >= self.deadline

    def _wake(self, agent: _Agent, delay_s: float, now: float) -> None:
        """Wake the agent after delay_s, but never past the deadline (a long think ends its step)."""
        at = now + max(0.0, min(delay_s, self.deadline - now))
        heapq.heappush(self._events, (at, next(self._order), agent))

    def _after_call(self, agent: _Agent, now: float) -> None:
        agent.turns_done += 1
        agent.session_turn += 1
        if self._done(agent, now):
            return
        self._wake(agent, self.workload.think.before(agent.next_turn()), now)

    def _call(self, agent: _Agent) -> None:
        if self._done(agent, self.now):
            return
        turn = agent.next_turn()
        tokens = self.prompts.tokens(turn)
        reuse = self.sent.expected_reuse(turn)
        self.sent.add(turn.hash_ids)
        max_tokens = self._max_tokens(turn, len(tokens))
        request_id = f"sim-{next(self._request_ids)}"
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        seq = Sequence(request_id, tokens, len(tokens), sampling, arrival_time=self.now)
        call = _Call(agent, seq, turn, self.now, reuse, max_tokens)
        if len(tokens) >= self.max_model_len:
            # The engine refuses it before any GPU work (a 400); the agent moves on.
            self._record(call, seq, error=f"prompt of {len(tokens)} tokens >= max_model_len {self.max_model_len}")
            self._after_call(agent, self.now)
            return
        self._reuse_lookup_hashes(agent.previous, seq)
        agent.previous = seq
        rank = self.router.route(agent.session_id, self.ranks[0].kv.lookup_hashes(seq), len(tokens))
        self.calls[request_id] = call
        rank.add(seq, self.now)

    def _max_tokens(self, turn: TraceTurn, input_tokens: int) -> int:
        """The trace's output, capped by --max-output-tokens and by the room the context leaves (as loadgen)."""
        wanted = turn.output_tokens
        if self.workload.max_output_tokens is not None:
            wanted = min(wanted, self.workload.max_output_tokens)
        room = min(self.workload.max_context, self.max_model_len) - int(input_tokens * 1.03) - 16
        return max(1, min(wanted, room))

    def _reuse_lookup_hashes(self, previous: Sequence | None, seq: Sequence) -> None:
        """Start seq's lookup hashes from the previous call's where their tokens agree: a turn resends the
        last one's context, and hashing 100K tokens again per call would dominate the simulation."""
        if previous is None:
            return
        limit = min(previous.num_prompt_tokens, seq.num_prompt_tokens)
        old, new = previous.token_ids, seq.token_ids
        low, high = 0, limit
        if old[:limit] == new[:limit]:  # the usual case: this turn extends the last one
            low = limit
        while low < high:  # else find where they part by halving (slice comparisons run at C speed)
            middle = (low + high + 1) // 2
            if old[:middle] == new[:middle]:
                low = middle
            else:
                high = middle - 1
        shared = low
        blocks = min(shared // self.node.rank.engine.block_size, len(previous.lookup_hashes))
        seq.lookup_hashes = previous.lookup_hashes[:blocks]

    def _record(self, call: _Call, seq: Sequence, error: str | None = None) -> None:
        answered = error is None and seq.first_token_time is not None
        cached = (seq.num_l0_cached_tokens or 0) + seq.num_l1_cached_tokens if answered else 0
        if answered:
            self._l1_tokens += seq.num_l1_cached_tokens
        agent = call.agent
        record = RequestRecord(
            agent=agent.index,
            session=agent.session.name if agent.session is not None else "",
            turn=agent.turns_done,
            session_turn=agent.session_turn,
            warm=call.reuse >= WARM_REUSE,
            expected_reuse=round(call.reuse, 4),
            expected_input_tokens=seq.num_prompt_tokens,
            max_tokens=call.max_tokens,
            sent_s=round(call.sent_s, 4),
            ttft_s=(seq.first_token_time - call.sent_s) if answered and seq.first_token_time else None,
            decode_s=(seq.finish_time - seq.first_token_time)
            if answered and seq.finish_time and seq.first_token_time
            else 0.0,
            output_tokens=seq.num_output_tokens if answered else 0,
            input_tokens=seq.num_prompt_tokens if answered else 0,
            cached_tokens=cached,
            error=error,
        )
        self.records.append(record)
        self._l1_by_record[id(record)] = seq.num_l1_cached_tokens if answered else 0


def replay(
    sessions: list[AgentTrace], workload: WorkloadSettings, node: NodeSettings, step_time: StepTimeModel
) -> ReplayResult:
    """Replay one step of workload.agents agents on the node; the load generator's records for it."""
    return Replay(sessions, workload, node, step_time).run()
