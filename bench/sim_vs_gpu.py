"""A measured agent step beside the simulator's replay of the same step, call by call: where they part.

The GPU side is the load generator's JSON of one step and the rank's log (each call's L0/L1 split, joined as
bench/cache_losses.py joins them); the simulator's is `kvserve bench simulate ... --json F --calls` for the same
agents, turns, seed and sizes. Calls are matched by (agent, turn): the same trace turns on both sides. Printed:
the tokens each tier served per window of the GPU's send times, the first calls whose L0 part differs by more
than --min-tokens, and cold calls' TTFT on both sides (the simulator's step-time model sets how fast cold
prompts get through, and with that how hard the pool is pressed).

    python bench/sim_vs_gpu.py RUN/raw/ours-agents-44.json RUN/logs/rank-worker-0.log.gz sim-44.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cache_losses import rank_splits, read_text  # noqa: E402


def pair_calls(
    gpu: dict[str, Any], splits: dict[tuple[int, int], list[tuple[int, int]]], sim_calls: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per answered call on both sides, in the GPU's send order; the GPU's L0/L1 None where the log's
    split is ambiguous (two calls of the same prompt and cached tokens that the rank split differently)."""
    by_key = {(c["agent"], c["turn"]): c for c in sim_calls if not c.get("error")}
    rows = []
    for call in gpu["requests"]:
        sim = by_key.get((call["agent"], call["turn"]))
        if call.get("error") or sim is None:
            continue
        found = splits.get((call["input_tokens"], call["cached_tokens"]), [])
        l0, l1 = found[0] if len(set(found)) == 1 else (None, None)
        sim_l1 = sim["l1_cached_tokens"]
        rows.append(
            {
                "agent": call["agent"],
                "turn": call["turn"],
                "warm": call["warm"],
                "sent_s": call["sent_s"],
                "prompt": call["input_tokens"],
                "gpu_l0": l0,
                "gpu_l1": l1,
                "gpu_ttft_s": call["ttft_s"],
                "sim_sent_s": sim["sent_s"],
                "sim_l0": sim["cached_tokens"] - sim_l1,
                "sim_l1": sim_l1,
                "sim_ttft_s": sim["ttft_s"],
            }
        )
    return sorted(rows, key=lambda row: row["sent_s"])


def windows(rows: list[dict[str, Any]], width_s: float) -> list[dict[str, Any]]:
    """Tokens from each tier on both sides per window of the GPU's send times (calls with a known split)."""
    out: dict[int, dict[str, Any]] = {}
    for row in rows:
        if row["gpu_l0"] is None:
            continue
        index = int(row["sent_s"] // width_s)
        entry = out.setdefault(
            index, {"from_s": index * width_s, "calls": 0, "gpu_l0": 0, "gpu_l1": 0, "sim_l0": 0, "sim_l1": 0}
        )
        entry["calls"] += 1
        for key in ("gpu_l0", "gpu_l1", "sim_l0", "sim_l1"):
            entry[key] += row[key]
    return [out[index] for index in sorted(out)]


def parted(rows: list[dict[str, Any]], min_tokens: int) -> list[dict[str, Any]]:
    """The calls whose L0 part differs by more than min_tokens, in the GPU's send order."""
    return [row for row in rows if row["gpu_l0"] is not None and abs(row["gpu_l0"] - row["sim_l0"]) > min_tokens]


def cold_ttft(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    def p(values: list[float], q: float) -> float | None:
        values = sorted(v for v in values if v is not None)
        return round(values[min(len(values) - 1, int(q * len(values)))], 2) if values else None

    cold = [row for row in rows if not row["warm"]]
    gpu, sim = [r["gpu_ttft_s"] for r in cold], [r["sim_ttft_s"] for r in cold]
    return {
        "calls": len(cold),
        "gpu_p50": p(gpu, 0.5),
        "gpu_p95": p(gpu, 0.95),
        "sim_p50": p(sim, 0.5),
        "sim_p95": p(sim, 0.95),
        "sim_over_gpu_median": round(statistics.median(s / g for s, g in zip(sim, gpu, strict=True) if g and s), 2)
        if cold
        else None,
    }


def compare(gpu: dict[str, Any], log_text: str, sim: dict[str, Any], width_s: float, min_tokens: int) -> dict:
    agents = gpu["steps"][0]["agents"]
    step = next((s for s in sim["steps"] if s["agents"] == agents), None)
    if step is None or "calls" not in step:
        raise SystemExit(f"the simulator's JSON has no step of {agents} agents with its calls (--calls)")
    rows = pair_calls(gpu, rank_splits(log_text), step["calls"])
    split = [row for row in rows if row["gpu_l0"] is not None]
    return {
        "agents": agents,
        "calls": len(rows),
        "calls_with_split": len(split),
        "totals": {key: sum(row[key] for row in split) for key in ("gpu_l0", "gpu_l1", "sim_l0", "sim_l1")},
        "windows": windows(rows, width_s),
        "parted": parted(rows, min_tokens),
        "cold_ttft": cold_ttft(rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("loadgen", type=Path, help="the load generator's JSON of one measured step")
    parser.add_argument("rank_log", type=Path, help="the rank worker's log of that run (plain or .gz)")
    parser.add_argument("sim", type=Path, help="kvserve bench simulate --json ... --calls of the same step")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of send time per row")
    parser.add_argument("--min-tokens", type=int, default=2000, help="an L0 difference that counts as parting")
    parser.add_argument("--top", type=int, default=15, help="parted calls to print, first sent first")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args(argv)
    result = compare(
        json.loads(args.loadgen.read_text()),
        read_text(args.rank_log),
        json.loads(args.sim.read_text()),
        args.window,
        args.min_tokens,
    )
    console = Console()
    totals = result["totals"]
    console.print(
        f"{result['agents']} agents, {result['calls']} calls on both sides ({result['calls_with_split']} with the "
        f"rank's split): L0 {totals['gpu_l0']:,} / L1 {totals['gpu_l1']:,} tokens measured, "
        f"L0 {totals['sim_l0']:,} / L1 {totals['sim_l1']:,} simulated"
    )
    table = Table("sent from s", "calls", "GPU L0", "GPU L1", "sim L0", "sim L1")
    for row in result["windows"]:
        table.add_row(
            f"{row['from_s']:g}", str(row["calls"]), *(f"{row[k]:,}" for k in ("gpu_l0", "gpu_l1", "sim_l0", "sim_l1"))
        )
    console.print(table)
    parted_rows = result["parted"]
    console.print(f"{len(parted_rows)} calls whose L0 part differs by more than {args.min_tokens:,} tokens; first:")
    table = Table("sent s", "agent", "turn", "prompt", "GPU L0", "GPU L1", "sim L0", "sim L1", "sim sent s")
    for row in parted_rows[: args.top]:
        table.add_row(
            f"{row['sent_s']:.1f}",
            *(str(row[k]) for k in ("agent", "turn", "prompt", "gpu_l0", "gpu_l1", "sim_l0", "sim_l1")),
            f"{row['sim_sent_s']:.1f}",
        )
    console.print(table)
    cold = result["cold_ttft"]
    console.print(
        f"cold calls ({cold['calls']}): TTFT p50 / p95 {cold['gpu_p50']} / {cold['gpu_p95']} s measured, "
        f"{cold['sim_p50']} / {cold['sim_p95']} s simulated (simulated / measured, median of calls: "
        f"{cold['sim_over_gpu_median']})"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
