"""Assemble bench/results/agents-h200.json from the raw files of the H200 run (bench/agents_h200.sh) and the
engine-level policy A/B (simulator/results/engine-check-h200.json), and draw the charts.

    python bench/agents_results.py --commit 55b3824
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEP_FIELDS = (
    "agents",
    "ttft_p50",
    "ttft_p95",
    "ttft_p95_warm",
    "ttft_p95_cold",
    "tok_s_p50",
    "tok_s_p10",
    "cache_hit",
    "errors",
    "passed",
)
EXTRA_FIELDS = ("requests", "expected_cache_hit", "cache_hit_l0", "cache_hit_l1", "input_tokens", "wall_s", "failed")


def step_row(step: dict) -> dict:
    row = {key: step[key] for key in STEP_FIELDS}
    row.update({key: step[key] for key in EXTRA_FIELDS if key in step})
    row["input_tokens_per_s"] = round(step["input_tokens"] / step["wall_s"], 1) if step.get("wall_s") else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw", default="bench/results/agents-h200-raw")
    parser.add_argument("--engine-check", default="simulator/results/engine-check-h200.json")
    parser.add_argument("--calibration", default="bench/results/agents-h200-calibration.json")
    parser.add_argument("--out", default="bench/results/agents-h200.json")
    parser.add_argument("--commit", required=True, help="the commit the GPU machine ran")
    args = parser.parse_args()
    raw = Path(args.raw)
    measured = json.loads((raw / "warm_first.json").read_text())
    engine_check = json.loads(Path(args.engine_check).read_text())
    ab = {row["policy"]: row for row in engine_check["rows"] if row["scenario"] == "cold-bursts"}
    calibration = json.loads(Path(args.calibration).read_text()) if Path(args.calibration).is_file() else None
    result = {
        "date": measured["date"][:10],
        "commit": args.commit,
        "gpu": (raw / "gpu.txt").read_text().strip(),
        "shape": "llama-8b (random weights, bf16) with SmolLM2's tokenizer: bench/shapes/llama-8b-chat",
        "stack": "kvserve up, bench/configs/agents-h200.yaml: redis, kvstore (48 GB L1), router, one rank, gateway",
        "workload": {
            "trace": "claude_code (62 real sessions)",
            "context_scale": measured["context_scale"],
            "turns_per_agent": measured["turns"],
            "think_time_s": measured["think_time"],
            "max_output_tokens": measured["max_output_tokens"],
            "ignore_eos": measured["ignore_eos"],
        },
        "thresholds": measured["thresholds"],
        "steps": [step_row(step) for step in measured["steps"]],
        "largest_passing": measured["largest_passing"],
        "policy": "warm_first",
        "ab": {
            "level": "engine (the real scheduler and model on the H200, no HTTP), scenario cold-bursts of "
            "simulator/engine_check.py: cold first turns arriving while other agents' warm turns run",
            "fifo": [ab["fifo"]["engine"]] if "fifo" in ab else [],
            "warm_first": [ab["warm_first"]["engine"]] if "warm_first" in ab else [],
        },
        "read_rate_ratio": None,
        "read_rate_note": "not measured: the run with prefix_cache off did not fit the session's GPU time",
        "simulator_calibration": calibration.get("calibration") if calibration else None,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    try:
        from loadgen.charts import draw_charts
        from loadgen.report import Thresholds

        charts = draw_charts(
            measured["steps"],
            str(Path(args.out).with_suffix("")),
            Thresholds(**measured["thresholds"]),
            title="llama-8b shape, H200, Claude Code traces:",
        )
        print("charts:", ", ".join(str(c) for c in charts))
    except ImportError as exc:
        print(f"no charts: {exc}")


if __name__ == "__main__":
    main()
