"""Assemble the agent benchmark's agents.json from the raw files of its H200 runs (bench/agents_h200.sh), and draw
the charts beside it, in the run folder (bench/results/2026-11-29-h200-agents/: raw/ and sim/ in it). Three runs,
each on its own commit (the GPU copy's git HEAD is stale, so they are given here):

  main/       `agents_h200.sh main`, STEPS=8,16 TURNS=20 MAX_OUT=64: the steps against the bar. Its JSON did not
              come back from the GPU machine (a call returns a limited number of files); the load generator's
              printed table did (main.out), and is parsed here into main/warm_first-table.json.
  readrate/   `agents_h200.sh readrate`, TURNS=6 MAX_OUT=64: 8 agents with prefix_cache off and on (the read
              rate), then 32 agents under warm_first and under FIFO (the stack-level A/B).
  gateway-fix/ `agents_h200.sh main`, STEPS=32 TURNS=6 MAX_OUT=64, after the gateway tokenizes off its loop.

    python bench/agents_results.py --main-commit b1296ce --readrate-commit 7f34109 --gateway-fix-commit 9a7409b
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.calibration import COMPARED  # noqa: E402

# The statistics every step reports (the ones the simulator's calibration compares), keyed by agent count.
STEP_FIELDS = ("agents", *COMPARED)
EXTRA_FIELDS = (
    "ttft_p50_warm",
    "ttft_p50_cold",
    "requests",
    "expected_cache_hit",
    "cache_hit_l0",
    "cache_hit_l1",
    "input_tokens",
    "wall_s",
    "failed",
)
TABLE_ROW = re.compile(
    r"│\s*(?P<agents>\d+)\s*│\s*(?P<calls>\d+)\s*│\s*(?P<p50>[\d.]+)\s*│\s*(?P<p95>[\d.]+)\s*│\s*(?P<warm>[\d.]+) / "
    r"(?P<cold>[\d.]+)\s*│\s*(?P<rate50>[\d.]+)\s*│\s*(?P<rate10>[\d.]+)\s*│\s*(?P<hit>[\d.]+)%\s*│\s*"
    r"(?P<l0>[\d.]+)% / "
    r"(?P<l1>[\d.]+)%\s*│\s*(?P<errors>[\d.]+)%\s*│\s*(?P<verdict>[^│]*?)\s*│"
)


def table_steps(printed: str) -> list[dict[str, Any]]:
    """The steps of the load generator's printed table (values as printed: 2 decimals, 1 for rates)."""
    steps = []
    for match in TABLE_ROW.finditer(printed):
        verdict = match["verdict"]
        steps.append(
            {
                "agents": int(match["agents"]),
                "requests": int(match["calls"]),
                "ttft_p50": float(match["p50"]),
                "ttft_p95": float(match["p95"]),
                "ttft_p95_warm": float(match["warm"]),
                "ttft_p95_cold": float(match["cold"]),
                "tok_s_p50": float(match["rate50"]),
                "tok_s_p10": float(match["rate10"]),
                "cache_hit": float(match["hit"]) / 100,
                "cache_hit_l0": float(match["l0"]) / 100,
                "cache_hit_l1": float(match["l1"]) / 100,
                "errors": float(match["errors"]) / 100,
                "passed": verdict == "PASS",
                "failed": [] if verdict == "PASS" else verdict.removeprefix("fail: ").replace(" ", "").split(","),
            }
        )
    if not steps:
        raise ValueError("no step rows in the printed table")
    return steps


def main_run(raw: Path) -> dict[str, Any]:
    """main/warm_first-table.json: the printed table as a load generator result (the workload as run)."""
    steps = table_steps((raw / "main" / "main.out").read_text())
    result = {
        "source": "parsed from main.out, the load generator's printed table (its JSON did not come back)",
        "workload": {"trace": "claude_code", "trace_path": ".whl/traces/claude_code", "sessions": 68},
        "context_scale": 0.1,
        "turns": 20,
        "think_time": "3",
        "max_output_tokens": 64,
        "ignore_eos": True,
        "seed": 1,
        "thresholds": {"ttft_p95_s": 15.0, "tok_s_p50": 20.0, "tok_s_p10": 10.0, "cache_hit": 0.9, "errors": 0.01},
        "steps": steps,
        "largest_passing": max((s["agents"] for s in steps if s["passed"]), default=None),
    }
    (raw / "main" / "warm_first-table.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def step_row(step: dict[str, Any], turns: int, run: str) -> dict[str, Any]:
    row = {key: step[key] for key in STEP_FIELDS}
    row.update({key: step[key] for key in EXTRA_FIELDS if key in step})
    row["turns_per_agent"] = turns
    row["run"] = run
    return row


def read_rates(nocache: dict[str, Any], cached: dict[str, Any], agents: int) -> dict[str, Any]:
    """Input tokens read per second of waiting (sum of input tokens / sum of TTFTs) with the cache and without,
    over the same agents, turns and prompts; also the warm turns alone and the wall-clock rate."""

    def rates(run: dict[str, Any]) -> dict[str, float]:
        calls = [r for r in run["requests"] if r["agents"] == agents and r["error"] is None and r["ttft_s"]]
        warm = [r for r in calls if r["warm"]]
        step = next(s for s in run["steps"] if s["agents"] == agents)
        return {
            "per_ttft_s": sum(r["input_tokens"] for r in calls) / sum(r["ttft_s"] for r in calls),
            "warm_per_ttft_s": sum(r["input_tokens"] for r in warm) / sum(r["ttft_s"] for r in warm),
            "per_wall_s": step["input_tokens"] / step["wall_s"],
        }

    off, on = rates(nocache), rates(cached)
    return {
        "agents": agents,
        "cache_on_tokens_per_s": {k: round(v) for k, v in on.items()},
        "cache_off_tokens_per_s": {k: round(v) for k, v in off.items()},
        "ratio": round(on["per_ttft_s"] / off["per_ttft_s"], 2),
        "ratio_warm_turns": round(on["warm_per_ttft_s"] / off["warm_per_ttft_s"], 2),
        "ratio_wall_clock": round(on["per_wall_s"] / off["per_wall_s"], 2),
    }


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw", default="bench/results/2026-11-29-h200-agents/raw", help="the run folder's raw/")
    parser.add_argument("--engine-check", default="simulator/results/engine-check-h200.json")
    parser.add_argument("--sim", default="", help="kvserve bench simulate JSONs (default: sim/ beside --raw)")
    parser.add_argument("--out", default="", help="default: agents.json beside --raw")
    parser.add_argument("--main-commit", required=True)
    parser.add_argument("--readrate-commit", required=True)
    parser.add_argument("--gateway-fix-commit", required=True)
    args = parser.parse_args()
    raw = Path(args.raw)
    main_steps = main_run(raw)
    nocache = load(raw / "readrate" / "nocache.json")
    readrate = load(raw / "readrate" / "warm_first.json")
    fifo = load(raw / "readrate" / "fifo.json")
    fixed = load(raw / "gateway-fix" / "warm_first.json")
    heavy = [s for s in fixed["steps"] if s["agents"] == 32]
    steps = [step_row(s, 20, "main") for s in main_steps["steps"]]
    steps += [step_row(s, 6, "gateway-fix") for s in heavy]
    engine_check = load(Path(args.engine_check))
    engine_ab = {row["policy"]: row for row in engine_check["rows"] if row["scenario"] == "cold-bursts"}
    sim = Path(args.sim) if args.sim else raw.parent / "sim"
    predicted = load(sim / "predict-20-turns.json")
    calibration = {
        "how": "kvserve bench simulate --config bench/configs/agents-h200.yaml --calibrate <measured JSON>: the real "
        "scheduler, cache and routing on a simulated clock, step times fitted to simulator/results/engine-h200.json "
        "and simulator/results/decode-h200.json (re-measured with the decode graphs and kernel); ratio = "
        "predicted / measured",
        "steps": load(sim / "calibrate-main.json")["calibration"]["steps"]
        + load(sim / "calibrate-32.json")["calibration"]["steps"],
        "prediction_20_turns": {
            "agents": [s["agents"] for s in predicted["steps"]],
            "passed": [s["passed"] for s in predicted["steps"]],
            "largest_passing": predicted["largest_passing"],
            "input_tokens_per_s": predicted["input_tokens_per_s"],
            "monthly_price": predicted["monthly_price"],
            "cost_per_million_input_tokens": predicted["cost_per_million_input_tokens"],
        },
    }
    passing = [s["agents"] for s in steps if s["passed"]]
    result = {
        "date": readrate["date"][:10],
        "commit": args.main_commit,
        "commits": {"main": args.main_commit, "readrate": args.readrate_commit, "gateway-fix": args.gateway_fix_commit},
        "gpu": (raw / "readrate" / "gpu.txt").read_text().strip(),
        "shape": "llama-8b (random weights, bf16) with SmolLM2's tokenizer: bench/shapes/llama-8b-chat",
        "stack": "kvserve up, bench/configs/agents-h200.yaml: redis, kvstore (48 GB L1), router, one rank, gateway",
        "engine": "decode steps replayed from CUDA graphs, decode attention by the Triton paged kernel, prefill eager",
        "workload": {
            "trace": "claude_code (68 sessions incl. subagents), replayed round-robin per agent",
            "context_scale": 0.1,
            "turns_per_agent": "20 (main run), 6 (readrate and gateway-fix runs)",
            "think_time_s": 3,
            "max_output_tokens": 64,
            "ignore_eos": True,
        },
        "thresholds": main_steps["thresholds"],
        "steps": steps,
        "largest_passing": max(passing, default=None),
        "largest_passing_note": "8 and 16 agents pass over 20 turns; 24 was not run; 32 fails on tok/s (10.8 p50: "
        "its decode steps read ~1M tokens of KV each, 45-50 ms) as well as on cache hit (79% over only 6 turns). "
        "The simulator predicts 28 over 20 turns, but it over-predicts tok/s 1.8x at 32 agents: an upper bound",
        "policy": "warm_first",
        "ab": {
            "level": "stack (kvserve up), 32 agents x 6 turns, all starting together, same seed and prompts",
            "commit": args.readrate_commit,
            "fifo": [step_row(s, 6, "readrate") for s in fifo["steps"]],
            "warm_first": [step_row(s, 6, "readrate") for s in readrate["steps"] if s["agents"] == 32],
        },
        "ab_engine": {
            "level": "engine (the real scheduler and model on the H200, no HTTP), scenario cold-bursts of "
            "simulator/engine_check.py, measured before the decode graphs and kernel",
            "fifo": [engine_ab["fifo"]["engine"]] if "fifo" in engine_ab else [],
            "warm_first": [engine_ab["warm_first"]["engine"]] if "warm_first" in engine_ab else [],
        },
        "read_rate_ratio": None,
        "read_rate": read_rates(nocache, readrate, 8),
        "simulator_calibration": calibration,
    }
    result["read_rate_ratio"] = result["read_rate"]["ratio"]
    out = Path(args.out) if args.out else raw.parent / "agents.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    try:
        from loadgen.charts import draw_charts
        from loadgen.report import Thresholds

        charts = draw_charts(
            steps,
            str(out.with_suffix("")),
            Thresholds.from_record(main_steps["thresholds"]),
            title="llama-8b shape, one H200, Claude Code traces:",
        )
        print("charts:", ", ".join(str(c) for c in charts))
    except ImportError as exc:
        print(f"no charts: {exc}")


if __name__ == "__main__":
    main()
