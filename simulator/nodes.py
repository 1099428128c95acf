"""N nodes behind the EPP in the simulator: `kvserve bench simulate --nodes N --node-choice prefix,round_robin`.

Each node is what the one-node simulator replays (replay.py): R simulated ranks, its own L1 host cache of the
configured size shared by its ranks, and its own router choosing the rank as today (routing.py). In front of them
the gateway's Endpoint Picker chooses the node of each call (node_choice.py). What the EPP knows of a node:

- its prefix: the leading prompt tokens its best rank's L0 holds, then what its L1 holds after those, read from
  the nodes' pools and L1 at the moment of the call (the EPP following every rank's and kvstore's KV events with
  no delay; the `prefix` policy only);
- its load: the sum of its ranks' reports (prefill still to do, the warm part of it, running sequences) at each
  heartbeat interval, as the node's router hears them, plus what the EPP sent there since.

Not modelled: the network between the EPP and the nodes, the EPP's own latency, nodes going down.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rich.console import Console
from rich.table import Table

from contracts.kv_events import KvEvent
from gateway.epp.node_choice import NodeCandidate, NodePolicy, choose_node
from loadgen.agent import RequestRecord
from loadgen.report import Thresholds, step_stats
from loadgen.traces import AgentTrace
from rank_worker.engine.sequence import Sequence as EngineSequence
from simulator.capacity import capacity_summary, replayed_step
from simulator.host_cache import NodeHostCache
from simulator.replay import NodeSettings, Replay, ReplayResult, WorkloadSettings, _Call
from simulator.routing import SimulatedRouter, rank_load
from simulator.sim_rank import ReplayRank, SimulatedRank
from simulator.step_time import StepTimeModel

# Per node, the step statistics the per-node table shows (loadgen.report.step_stats over the node's calls).
NODE_COLUMNS = ("requests", "ttft_p95", "ttft_p95_warm", "cache_hit", "expected_cache_hit", "tok_s_p50")


@dataclass
class _NodeLoad:
    queued_prefill_tokens: int = 0
    queued_warm_prefill_tokens: int = 0
    running: int = 0


class _NodeRank(SimulatedRank):
    """A simulated rank that tells the fleet which node each call went to."""

    def __init__(self, node_index: int, node_of: dict[str, int], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.node_index = node_index
        self._node_of = node_of

    def add(self, seq: EngineSequence, now: float) -> None:
        self._node_of[seq.request_id] = self.node_index
        super().add(seq, now)


class FleetRouter:
    """The EPP in front of every node's router: choose the node (node_choice.py), then that node's router
    chooses the rank. One node: its router alone, exactly as the one-node replay routes."""

    def __init__(
        self,
        nodes: Sequence[tuple[list[ReplayRank], NodeHostCache | None, SimulatedRouter]],
        policy: NodePolicy,
        block_size: int,
    ) -> None:
        self.nodes = list(nodes)
        self.policy = policy
        self.block_size = block_size
        self.node_ids = [f"node-{index}" for index in range(len(self.nodes))]
        self._node_of_rank = {rank.rank_id: index for index, (ranks, _, _) in enumerate(self.nodes) for rank in ranks}
        self.loads = [_NodeLoad() for _ in self.nodes]  # the last heartbeat's sums, plus what was sent since
        self.sessions: dict[str, int] = {}  # session id -> the node of its last turn
        self.node_reasons: dict[str, int] = {}
        self.node_sessions: list[set[str]] = [set() for _ in self.nodes]
        self._requests = 0

    @property
    def needed(self) -> bool:
        return len(self.nodes) > 1 or self.nodes[0][2].needed

    @property
    def reasons(self) -> dict[str, int]:
        """The nodes' routers' reasons for their rank choices, summed."""
        total: dict[str, int] = {}
        for _, _, router in self.nodes:
            for reason, count in router.reasons.items():
                total[reason] = total.get(reason, 0) + count
        return total

    def heartbeat(self) -> None:
        for index, (ranks, _, router) in enumerate(self.nodes):
            if router.needed:
                router.heartbeat()
            loads = [rank_load(rank) for rank in ranks]
            self.loads[index] = _NodeLoad(
                queued_prefill_tokens=sum(load.waiting_prefill_tokens for load in loads),
                queued_warm_prefill_tokens=sum(load.waiting_warm_prefill_tokens for load in loads),
                running=sum(load.running for load in loads),
            )

    def rank_events(self, rank_id: str, events: list[KvEvent]) -> None:
        self.nodes[self._node_of_rank[rank_id]][2].rank_events(rank_id, events)

    def route(self, session_id: str, lookup_hashes: list[bytes], prompt_tokens: int) -> ReplayRank:
        if len(self.nodes) == 1:
            return self.nodes[0][2].route(session_id, lookup_hashes, prompt_tokens)
        candidates = [
            self._candidate(index, lookup_hashes if self.policy.name == "prefix" else None)
            for index in range(len(self.nodes))
        ]
        session = self.sessions.get(session_id)
        choice = choose_node(
            candidates,
            prompt_tokens,
            self.node_ids[session] if session is not None else None,
            self.policy,
            self._requests,
        )
        assert choice is not None
        self._requests += 1
        index = self.node_ids.index(choice.node_id)
        load = self.loads[index]
        load.queued_prefill_tokens += choice.new_prefill_tokens
        if choice.warm:
            load.queued_warm_prefill_tokens += choice.new_prefill_tokens
        self.sessions[session_id] = index
        self.node_sessions[index].add(session_id)
        self.node_reasons[choice.reason] = self.node_reasons.get(choice.reason, 0) + 1
        return self.nodes[index][2].route(session_id, lookup_hashes, prompt_tokens)

    def _candidate(self, index: int, lookup_hashes: list[bytes] | None) -> NodeCandidate:
        ranks, cache, _ = self.nodes[index]
        l0_blocks = l1_blocks = 0
        if lookup_hashes:
            l0_blocks = max(len(rank.kv.pool.cached_run(lookup_hashes)) for rank in ranks)
            if cache is not None:
                l1_blocks = cache.leading_run(lookup_hashes[l0_blocks:])
        load = self.loads[index]
        return NodeCandidate(
            node_id=self.node_ids[index],
            ranks=len(ranks),
            l0_tokens=l0_blocks * self.block_size,
            l1_tokens=l1_blocks * self.block_size,
            queued_prefill_tokens=load.queued_prefill_tokens,
            queued_warm_prefill_tokens=load.queued_warm_prefill_tokens,
            running=load.running,
        )


class FleetReplay(Replay):
    """One step of agents replayed on `nodes` nodes of `node` behind the EPP."""

    def __init__(
        self,
        sessions: list[AgentTrace],
        workload: WorkloadSettings,
        node: NodeSettings,
        step_time: StepTimeModel,
        nodes: int,
        policy: NodePolicy,
    ) -> None:
        if nodes < 1:
            raise ValueError("--nodes must be at least 1")
        self.fleet_size = nodes
        self.node_policy = policy
        self.node_of: dict[str, int] = {}  # request id -> node
        self._record_node: dict[int, int] = {}  # id(record) -> node
        super().__init__(sessions, workload, node, step_time)

    def _build_ranks(
        self, step_time: StepTimeModel, make_rank: Callable[[int, Callable[[], float]], ReplayRank] | None
    ) -> tuple[list[ReplayRank], Any]:
        node = self.node
        built = []
        for index in range(self.fleet_size):
            cache = NodeHostCache(node.l1_blocks) if node.l1_blocks > 0 else None
            prefix = "" if self.fleet_size == 1 else f"node-{index}/"
            ranks: list[ReplayRank] = [
                _NodeRank(
                    index, self.node_of, f"{prefix}rank-{i}", node.rank, self.namespace, step_time, self.clock, cache
                )
                for i in range(node.ranks)
            ]
            built.append((ranks, cache, SimulatedRouter(ranks, node.route, cache, self.clock)))
        self.node_cache = built[0][1]
        self.fleet = FleetRouter(built, self.node_policy, built[0][0][0].kv.block_size)
        return [rank for ranks, _, _ in built for rank in ranks], self.fleet

    def _record(self, call: _Call, seq: EngineSequence, error: str | None = None) -> None:
        super()._record(call, seq, error)
        node = self.node_of.get(seq.request_id)
        if node is not None:
            self._record_node[id(self.records[-1])] = node

    def node_records(self) -> list[list[RequestRecord]]:
        """The replayed calls per node (calls refused before routing are in none)."""
        per_node: list[list[RequestRecord]] = [[] for _ in range(self.fleet_size)]
        for record in self.records:
            node = self._record_node.get(id(record))
            if node is not None:
                per_node[node].append(record)
        return per_node


def _node_stats(run: FleetReplay, result: ReplayResult, thresholds: Thresholds) -> list[dict[str, Any]]:
    rows = []
    ranks_per_node = run.node.ranks
    for index, records in enumerate(run.node_records()):
        agents = len({record.agent for record in records})
        stats = step_stats(records, max(agents, 1), None, result.wall_s, thresholds) if records else {}
        busy = result.rank_busy_s[index * ranks_per_node : (index + 1) * ranks_per_node]
        row: dict[str, Any] = {"node": index, "agents_seen": agents, "sessions": len(run.fleet.node_sessions[index])}
        row.update({key: stats.get(key) for key in NODE_COLUMNS})
        row["requests"] = len(records)
        row["input_tokens"] = sum(record.input_tokens for record in records)
        row["busy_s"] = round(sum(busy), 2)
        row["busy_share"] = round(sum(busy) / (len(busy) * result.wall_s), 4) if result.wall_s > 0 else None
        rows.append(row)
    return rows


def simulate_fleet_steps(
    sessions: list[AgentTrace],
    agent_counts: Sequence[int],
    workload: WorkloadSettings,
    node: NodeSettings,
    step_time: StepTimeModel,
    nodes: int,
    policy: NodePolicy,
    thresholds: Thresholds = Thresholds(),
) -> list[dict[str, Any]]:
    """As capacity.simulate_steps, on `nodes` nodes behind the EPP: per step also `fleet` (the EPP's reasons and
    per-node statistics)."""
    steps: list[dict[str, Any]] = []
    for index, agents in enumerate(agent_counts):
        run = FleetReplay(sessions, replace(workload, agents=agents, step_index=index), node, step_time, nodes, policy)
        result = run.run()
        stats = replayed_step(result, agents, thresholds)
        stats["fleet"] = {
            "nodes": nodes,
            "node_choice": policy.name,
            "node_reasons": dict(run.fleet.node_reasons),
            "per_node": _node_stats(run, result, thresholds),
        }
        steps.append(stats)
    return steps


def node_choices(text: str | None, nodes: int) -> tuple[str, ...]:
    """--node-choice as a tuple of policies (default: prefix); with one node there is nothing to choose."""
    if nodes < 1:
        raise ValueError("--nodes must be at least 1")
    names = tuple(part.strip() for part in (text or "prefix").split(",") if part.strip())
    for name in names:
        NodePolicy(name)  # raises on an unknown name
    if not names:
        raise ValueError("--node-choice needs a policy, e.g. prefix,round_robin")
    return names if nodes > 1 else names[:1]


def run_node_choices(
    sessions: list[AgentTrace],
    agent_counts: Sequence[int],
    workload: WorkloadSettings,
    node: NodeSettings,
    step_time: StepTimeModel,
    nodes: int,
    choices: Sequence[str],
    thresholds: Thresholds,
    title: str,
    print_table: Callable[[str, list[dict[str, Any]]], None],
) -> dict[str, list[dict[str, Any]]]:
    """Every node-choice policy's steps on `nodes` nodes, each printed (the load generator's table, then per node)
    with its largest passing N; the node router's settings (l1_restore_cost, overload) are the EPP's too."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in choices:
        policy = NodePolicy(
            name,
            l1_restore_cost=node.route.l1_restore_cost,
            overload_prefill_tokens=node.route.overload_prefill_tokens,
            warm_prefix_fraction=node.route.warm_prefix_fraction,
        )
        steps = simulate_fleet_steps(sessions, agent_counts, workload, node, step_time, nodes, policy, thresholds)
        runs[name] = steps
        label = f"{title}, {nodes} nodes x {node.ranks} rank(s), node choice {name}"
        print_table(label, steps)
        print_node_table(label, steps)
        best = capacity_summary(steps, None)["largest_passing"]
        _console().print(f"largest passing N on {nodes} nodes x {node.ranks} rank(s), {name}: {best or 'none'}")
    return runs


def node_choice_results(runs: dict[str, list[dict[str, Any]]], monthly_price: float | None) -> dict[str, Any]:
    """Per policy: its steps and largest passing N (with its rate and cost), for the results JSON."""
    return {name: {**capacity_summary(steps, monthly_price), "steps": steps} for name, steps in runs.items()}


def print_node_table(title: str, steps: list[dict[str, Any]]) -> None:
    table = Table(title=f"per node ({title})")
    for column in ("agents", "node", "sessions", *NODE_COLUMNS, "busy"):
        table.add_column(column, justify="right")
    for step in steps:
        for row in step["fleet"]["per_node"]:

            def cell(key: str, row: dict[str, Any] = row) -> str:
                value = row.get(key)
                if value is None:
                    return "-"
                if key in ("cache_hit", "expected_cache_hit"):
                    return f"{100 * value:.1f}%"
                return f"{value:.2f}" if isinstance(value, float) else str(value)

            share = row.get("busy_share")
            busy = "-" if share is None else f"{100 * share:.0f}%"
            table.add_row(str(step["agents"]), str(row["node"]), cell("sessions"), *map(cell, NODE_COLUMNS), busy)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(step["fleet"]["node_reasons"].items()))
        table.add_row(str(step["agents"]), "EPP", reasons, *[""] * (len(NODE_COLUMNS) + 1))
    _console().print(table)


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 160)
