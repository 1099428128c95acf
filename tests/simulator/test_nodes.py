"""N nodes behind the EPP: the node choice itself (sticky sessions, a prefix in one node's L1 wins, an overloaded
node sheds, least loaded otherwise, the plain policies), a fleet where prefix-aware choice serves at least as many
agents as round robin, and one node replaying exactly as the one-node simulator does."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest
from sim_workloads import h200_step_time, node, sessions

from gateway.epp.node_choice import NodeCandidate, NodePolicy, choose_node
from loadgen.agent import ThinkTime
from simulator.capacity import capacity_summary, simulate_steps
from simulator.cli import main
from simulator.nodes import FleetReplay, simulate_fleet_steps
from simulator.replay import WorkloadSettings, replay

STEP_TIME = h200_step_time()
THINK = ThinkTime(fixed=3.0)
PREFIX = NodePolicy("prefix", l1_restore_cost=0.1, overload_prefill_tokens=32768)


def _node(
    node_id: str, l0: int = 0, l1: int = 0, queued: int = 0, warm_queued: int = 0, running: int = 0
) -> NodeCandidate:
    return NodeCandidate(node_id, 1, l0, l1, queued, warm_queued, running)


def test_a_session_sticks_to_its_node_though_another_is_emptier() -> None:
    nodes = [_node("node-0", l0=9000, queued=20000, running=4), _node("node-1")]
    choice = choose_node(nodes, 10000, "node-0", PREFIX)
    assert choice is not None and (choice.node_id, choice.reason) == ("node-0", "session")
    assert choice.warm and choice.new_prefill_tokens == 1000


def test_a_prefix_held_in_one_nodes_l1_wins() -> None:
    nodes = [_node("node-0", queued=2000), _node("node-1", l1=9600, queued=2000), _node("node-2")]
    choice = choose_node(nodes, 10000, None, PREFIX)
    assert choice is not None and (choice.node_id, choice.reason) == ("node-1", "prefix")
    assert choice.new_prefill_tokens == 400 + 960  # uncached plus the restore at 0.1 a token


def test_an_overloaded_node_sheds_its_session_and_new_ones() -> None:
    busy = _node("node-0", l0=2000, queued=200_000, warm_queued=100_000)
    nodes = [busy, _node("node-1")]
    choice = choose_node(nodes, 10000, "node-0", PREFIX)
    assert choice is not None and (choice.node_id, choice.reason) == ("node-1", "overloaded-session-node")
    # A new session whose prefix only the overloaded node holds goes elsewhere too.
    hot = replace(busy, l0_tokens=9600)
    choice = choose_node([hot, _node("node-1", queued=5000)], 10000, None, PREFIX)
    assert choice is not None and choice.node_id == "node-1"
    # Everyone overloaded: the best score among them.
    choice = choose_node([hot, _node("node-1", queued=400_000)], 10000, None, PREFIX)
    assert choice is not None and choice.node_id == "node-0"


def test_without_a_prefix_the_least_loaded_node_wins() -> None:
    nodes = [_node("node-0", queued=8000), _node("node-1", queued=3000, running=2), _node("node-2", queued=9000)]
    choice = choose_node(nodes, 10000, None, PREFIX)
    assert choice is not None and (choice.node_id, choice.reason) == ("node-1", "load")
    plain = choose_node(nodes, 10000, "node-0", NodePolicy("least_loaded"))
    assert plain is not None and (plain.node_id, plain.reason) == ("node-1", "least-loaded")  # no stickiness
    picks = [choose_node(nodes, 10000, "node-0", NodePolicy("round_robin"), turn) for turn in range(4)]
    assert [c.node_id for c in picks if c] == ["node-0", "node-1", "node-2", "node-0"]
    with pytest.raises(ValueError):
        NodePolicy("random")
    assert choose_node([], 10, None, PREFIX) is None


def test_one_node_replays_as_the_one_node_simulator() -> None:
    work = sessions(6, base_blocks=100, turns=4, output=8)
    workload = WorkloadSettings(agents=6, turns=4, think=THINK, stagger_s=1.0)
    for ranks, l1 in ((1, 0), (2, 4000)):
        settings = replace(node(ranks, num_blocks=4096), l1_blocks=l1)
        today = replay(work, workload, settings, STEP_TIME)
        fleet = FleetReplay(work, workload, settings, STEP_TIME, 1, NodePolicy("prefix")).run()
        assert fleet.records == today.records and fleet.wall_s == today.wall_s
        assert fleet.cached_by_tier == today.cached_by_tier and fleet.route_reasons == today.route_reasons
    steps = simulate_steps(work, [3, 6], workload, node(2), STEP_TIME)
    fleet_steps = simulate_fleet_steps(work, [3, 6], workload, node(2), STEP_TIME, 1, NodePolicy("round_robin"))
    assert [{k: v for k, v in s.items() if k != "fleet"} for s in fleet_steps] == steps


def test_prefix_aware_node_choice_serves_at_least_as_many_agents_as_round_robin() -> None:
    # Long sessions (20K tokens growing 128 a turn) on 2 nodes of one rank with a small L1 each: a turn sent to
    # the other node finds its prefix in neither cache there.
    work = sessions(16, base_blocks=320, turns=6, output=24)
    workload = WorkloadSettings(agents=1, turns=6, think=THINK)
    settings = replace(node(1), l1_blocks=40_000)
    best = {}
    for name in ("prefix", "round_robin"):
        steps = simulate_fleet_steps(work, [4, 8, 16], workload, settings, STEP_TIME, 2, NodePolicy(name))
        best[name] = capacity_summary(steps, monthly_price=None)["largest_passing"] or 0
        last = steps[-1]
        assert all(row["requests"] > 0 for row in last["fleet"]["per_node"])
        if name == "prefix":
            assert last["fleet"]["node_reasons"].get("session", 0) >= 16 * 5 * 0.9  # later turns stay put
            assert all(row["sessions"] <= 10 for row in last["fleet"]["per_node"])  # and new ones spread
            prefix_hit = last["cache_hit"]
        else:
            # Turns that land on the other node find there only what an earlier visit left (or nothing).
            assert last["cache_hit"] < prefix_hit - 0.05 and last["failed"] == ["cache_hit"]
    assert best["prefix"] >= best["round_robin"] and best["prefix"] == 16


def test_simulate_with_nodes_prints_and_writes_each_node_choice(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    for s in range(4):
        requests = [
            {
                "t": 5.0 * turn,
                "type": "s",
                "in": (190 + 4 * turn) * 64,
                "out": 20,
                "hash_ids": list(range(1, 191 + 4 * turn)),
            }
            for turn in range(4)
        ]
        with gzip.open(traces / f"trace_{s + 1:04d}.json.gz", "wt") as f:
            json.dump({"id": f"trace_{s + 1:04d}", "block_size": 64, "requests": requests}, f)
    out = tmp_path / "nodes.json"
    args = ["--trace-path", str(traces), "--agents", "2,4", "--turns", "4", "--nodes", "2", "--l1-gb", "4"]
    assert main([*args, "--node-choice", "prefix,round_robin", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["nodes"] == 2 and set(results["node_choice"]) == {"prefix", "round_robin"}
    assert results["steps"] == results["node_choice"]["prefix"]["steps"]  # the first policy is the headline
    for name, run in results["node_choice"].items():
        assert "largest_passing" in run
        for step in run["steps"]:
            assert step["fleet"]["node_choice"] == name and len(step["fleet"]["per_node"]) == 2
            assert sum(row["requests"] for row in step["fleet"]["per_node"]) == step["requests"]
    assert main([*args, "--node-choice", "random"]) == 2
    assert main([*args, "--nodes", "0"]) == 2
