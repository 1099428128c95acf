"""Hand-made agent traces for simulator tests (no trace files needed), and a node like the measured H200's."""

from __future__ import annotations

from pathlib import Path

from contracts.config import EngineConfig, SchedulingConfig
from loadgen.traces import AgentTrace, TraceTurn
from simulator.replay import NodeSettings
from simulator.sim_rank import RankSettings
from simulator.step_time import StepTimeModel, fit_step_time, load_engine_results

ROOT = Path(__file__).resolve().parents[2]
ENGINE_RESULTS = ROOT / "simulator" / "results" / "engine-h200.json"  # the calibration (simulator/cli.py)
DECODE_PROBE = ROOT / "simulator" / "results" / "decode-h200.json"
BLOCK = 64  # tokens per hash id, as in the Claude Code traces


def h200_step_time() -> StepTimeModel:
    """The model `kvserve bench simulate` uses by default: the engine benchmark plus the decode probe."""
    return fit_step_time(load_engine_results(ENGINE_RESULTS), load_engine_results(DECODE_PROBE))


def growing_session(
    name: str, first_id: int, base_blocks: int, grow_blocks: int, turns: int, output: int
) -> AgentTrace:
    """A coding-agent session: every call resends the whole conversation plus grow_blocks new blocks."""
    calls = []
    for turn in range(turns):
        ids = tuple(range(first_id, first_id + base_blocks + turn * grow_blocks))
        calls.append(TraceTurn(float(turn), 3.0, len(ids) * BLOCK, output, ids, BLOCK))
    return AgentTrace(name=name, turns=tuple(calls))


def cold_session(name: str, first_id: int, blocks: int, turns: int, output: int) -> AgentTrace:
    """Calls that share nothing with anything: every one is a full cold prefill."""
    calls = []
    for turn in range(turns):
        start = first_id + turn * blocks
        ids = tuple(range(start, start + blocks))
        calls.append(TraceTurn(float(turn), 3.0, blocks * BLOCK, output, ids, BLOCK))
    return AgentTrace(name=name, turns=tuple(calls))


def sessions(count: int, base_blocks: int, grow_blocks: int = 2, turns: int = 12, output: int = 40) -> list[AgentTrace]:
    return [
        growing_session(f"s{i}", (i + 1) * 1_000_000, base_blocks, grow_blocks, turns, output) for i in range(count)
    ]


def node(ranks: int = 1, policy: str = "warm_first", num_blocks: int = 52470, **rank: object) -> NodeSettings:
    """A node of ranks alike; rank: RankSettings' fields, or engine keys over its default engine (flat)."""
    engine = {key: rank.pop(key) for key in list(rank) if key in EngineConfig.model_fields}
    default = RankSettings(num_blocks=num_blocks)
    settings = RankSettings(
        num_blocks=num_blocks,
        engine=default.engine.model_copy(update=engine),
        policy=SchedulingConfig(scheduling_policy=policy),
        **rank,  # type: ignore[arg-type]
    )
    return NodeSettings(ranks=ranks, rank=settings)
