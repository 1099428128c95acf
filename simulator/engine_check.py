"""The simulator against the real engine: the same replay (agents, think times, scheduler) once with simulated
ranks and once with a real PagedEngine rank on the GPU, whose steps are timed instead of modelled, and the
load generator's step statistics of both side by side.

The replay's clock advances by each real step's measured duration (and by think times, which are not slept),
so the difference between the two runs is the step-time model's error in a realistic mix of prefill chunks,
warm turns and decodes. What neither run has: the gateway, HTTP and tokenization of a full-stack run (the
calibration against the load generator's measurements covers those).

    python -m simulator.engine_check --out simulator/results/engine-check-h200.json     # on the GPU
    python -m simulator.engine_check --quick --shape tiny                               # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contracts.config import EngineConfig, SchedulingConfig  # noqa: E402
from loadgen.agent import ThinkTime  # noqa: E402
from loadgen.report import step_stats  # noqa: E402
from loadgen.traces import AgentTrace, TraceTurn, synthetic  # noqa: E402
from rank_worker.engine.factory import build_random_model  # noqa: E402
from rank_worker.engine.interface import EngineRequest, SamplingParams  # noqa: E402
from rank_worker.engine.paged_engine import EngineSettings, PagedEngine  # noqa: E402
from rank_worker.engine.sequence import Sequence, SequenceStatus  # noqa: E402
from simulator.replay import NodeSettings, Replay, WorkloadSettings  # noqa: E402
from simulator.sim_rank import RankSettings, StepOutcome  # noqa: E402
from simulator.step_time import StepTimeModel, fit_step_time, load_engine_results  # noqa: E402

COMPARED = ("ttft_p50", "ttft_p95", "ttft_p95_warm", "ttft_p95_cold", "tok_s_p50", "tok_s_p10", "cache_hit", "wall_s")


def in_vocabulary(token_ids: list[int], vocab: int) -> list[int]:
    """The replay's token ids (distinct runs per hash id, beyond any vocabulary) mixed into [0, vocab): equal
    ids stay equal and different blocks practically never collide, so the reuse pattern is the replay's."""
    x = np.array(token_ids, dtype=np.int64).view(np.uint64)
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):  # a 64-bit finalizer (murmur3's)
        x ^= x >> np.uint64(33)
        x *= np.uint64(multiplier)
    x ^= x >> np.uint64(33)
    return (x % np.uint64(vocab)).astype(np.int64).tolist()


class EngineRank:
    """A rank of the replay that runs the real engine: requests go in as the replay's sequences come, each
    step is timed on the device, and the replay's sequences get the engine's results at the step's end."""

    def __init__(self, engine: PagedEngine, settings: RankSettings, clock: Callable[[], float]) -> None:
        self.rank_id = "engine"
        self.engine = engine
        self.settings = settings
        self.scheduler = engine.scheduler
        self.scheduler.clock = clock
        self.kv = engine.kv
        self.vocab = engine.model.cfg.vocab_size
        self.busy_until = 0.0
        self.busy_s = 0.0
        self.steps = 0
        self._mine: dict[str, Sequence] = {}

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def add(self, seq: Sequence, now: float) -> None:
        if not self.has_work:
            self.busy_until = max(self.busy_until, now)
        tokens = in_vocabulary(seq.token_ids, self.vocab)
        sampling = SamplingParams(max_tokens=seq.sampling.max_tokens, ignore_eos=True)
        self.engine.add_request(EngineRequest(seq.request_id, tokens, sampling, arrival_time=now))
        self._mine[seq.request_id] = seq

    def step(self, now: float) -> StepOutcome:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = self.engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        end = now + time.perf_counter() - start
        outcome = StepOutcome(start=now, end=end, first_tokens=[], finished=[], events=[])
        for out in outputs:
            seq = self._mine[out.request_id]
            seq.token_ids.extend([0] * len(out.new_token_ids))  # counts only: outputs are never reused
            if out.stats is not None:
                seq.num_l0_cached_tokens = out.stats.l0_cached_tokens
                seq.num_l1_cached_tokens = out.stats.l1_cached_tokens
            if seq.first_token_time is None:
                seq.first_token_time = end
                outcome.first_tokens.append(seq)
            if out.finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_time = end
                outcome.finished.append(self._mine.pop(out.request_id))
        self.engine.drain_kv_events()
        self.busy_until = end
        self.busy_s += end - now
        self.steps += 1
        return outcome


def _engine(shape: str, rank: RankSettings, max_len: int) -> PagedEngine:
    model = build_random_model(str(ROOT / "bench" / "shapes" / shape / "config.json"), max_len)
    settings = EngineSettings(
        num_blocks=rank.num_blocks, max_model_len=max_len, engine=rank.engine, scheduling=rank.policy
    )
    return PagedEngine(model, settings)


def _growing(name: str, first_id: int, block_tokens: int) -> AgentTrace:
    """A session of 15 calls, each resending the last plus two blocks (about 8K tokens at 64 per block)."""
    turns = []
    for index in range(15):
        ids = tuple(range(first_id, first_id + 120 + 2 * index))
        turns.append(TraceTurn(float(index), 1.0, len(ids) * block_tokens, 20, ids, block_tokens))
    return AgentTrace(name, tuple(turns))


def _cold(name: str, first_id: int, block_tokens: int) -> AgentTrace:
    """Calls of 600 blocks (38K tokens at 64 per block) that share nothing: every one a cold prefill."""
    turns = []
    for index in range(6):
        ids = tuple(range(first_id + index * 1000, first_id + index * 1000 + 600))
        turns.append(TraceTurn(float(index), 1.0, len(ids) * block_tokens, 4, ids, block_tokens))
    return AgentTrace(name, tuple(turns))


def scenarios(quick: bool) -> list[dict[str, Any]]:
    """A growing-context mix, and warm agents among cold bursts under both policies."""
    scale = 16 if quick else 1  # --quick: 16x smaller contexts
    growing = synthetic(32_000 // scale, agents=8, turns=5, seed=1, sizes_from=[])
    bursts: list[AgentTrace] = []
    for i in range(6):  # agent 2i replays a warm session, agent 2i+1 a cold one
        bursts += [_growing(f"w{i}", (i + 1) * 10**6, 64 // scale), _cold(f"c{i}", (i + 101) * 10**6, 64 // scale)]
    return [
        {"name": "growing-32k", "sessions": growing, "agents": 8, "turns": 5, "think": 3.0, "policy": "warm_first"},
        {"name": "cold-bursts", "sessions": bursts, "agents": 12, "turns": 6, "think": 1.0, "policy": "fifo"},
        {"name": "cold-bursts", "sessions": bursts, "agents": 12, "turns": 6, "think": 1.0, "policy": "warm_first"},
    ]


def run_scenario(
    scenario: dict[str, Any], rank: RankSettings, step_time: StepTimeModel, engine: PagedEngine | None
) -> dict[str, Any]:
    policy = SchedulingConfig(scheduling_policy=scenario["policy"])
    node = NodeSettings(1, RankSettings(**{**rank.__dict__, "policy": policy}))
    workload = WorkloadSettings(
        agents=scenario["agents"], turns=scenario["turns"], think=ThinkTime(fixed=scenario["think"])
    )
    make_rank = None
    if engine is not None:
        engine.scheduler.policy = policy
        engine.pool.clear_cache()  # every scenario starts cold, as the simulated one does

        def make_rank(index: int, clock: Callable[[], float]) -> EngineRank:
            return EngineRank(engine, node.rank, clock)

    replay = Replay(scenario["sessions"], workload, node, step_time, make_rank)
    result = replay.run()
    stats = step_stats(result.records, scenario["agents"], result.cached_by_tier, result.wall_s)
    return {name: stats.get(name) for name in (*COMPARED, "requests", "errors")} | {"steps": result.rank_steps[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--engine-results", default=str(ROOT / "simulator" / "results" / "engine-h200.json"))
    parser.add_argument("--decode-results", default=str(ROOT / "simulator" / "results" / "decode-h200.json"))
    parser.add_argument("--num-blocks", type=int, default=40_000)
    parser.add_argument("--quick", action="store_true", help="tiny contexts (a CPU smoke run of the script)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    probe = load_engine_results(args.decode_results) if Path(args.decode_results).is_file() else None
    step_time = fit_step_time(load_engine_results(args.engine_results), probe)
    rank = RankSettings(num_blocks=args.num_blocks, engine=EngineConfig(max_num_seqs=64, max_num_batched_tokens=32768))
    max_len = 65_536
    engine = _engine(args.shape, rank, max_len)
    rank = RankSettings(**{**rank.__dict__, "max_model_len": max_len})
    rows = []
    for scenario in scenarios(args.quick):
        predicted = run_scenario(scenario, rank, step_time, None)
        measured = run_scenario(scenario, rank, step_time, engine)
        ratios = {
            name: round(predicted[name] / measured[name], 3)
            for name in COMPARED
            if isinstance(predicted.get(name), float | int) and measured.get(name)
        }
        row = {"scenario": scenario["name"], "policy": scenario["policy"], "simulated": predicted}
        rows.append(row | {"engine": measured, "ratio": ratios})
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "shape": args.shape,
        "step_time_model": step_time.to_json(),
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
