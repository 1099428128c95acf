"""Where the GPU waits on the host, from a step trace (KVSERVE_STEP_TRACE, rank_worker/engine/step_trace.py).

Paints the traced window in bins of --bin-us: a bin is busy when a kernel runs in it (any stream), and each bin
carries the innermost phase of the engine thread then (loop.add, engine.step > l1.poll / schedule / launch /
sample / read / complete, loop.deliver, loop.after; "none" outside them) and the innermost torch op. Prints how
much of the window the GPU was idle, and the idle time by phase and by phase and op; --out writes it as JSON.
Standard library only, so it runs on the GPU machine beside the trace.

    python3 bench/probes/trace_gaps.py trace.json[.gz] [--out gaps.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memset"}
STEP_PHASE = "engine.step"


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def analyse(events: list[dict], bin_us: float) -> dict:
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    phases = [e for e in complete if e.get("cat") == "user_annotation"]
    steps = [e for e in phases if e["name"] == STEP_PHASE]
    if not steps:
        raise SystemExit("no engine.step ranges in the trace: was it recorded with KVSERVE_STEP_TRACE?")
    engine_tid = Counter((e["pid"], e["tid"]) for e in steps).most_common(1)[0][0]
    start = min(e["ts"] for e in steps)
    end = max(e["ts"] + e["dur"] for e in steps)
    bins = int((end - start) / bin_us) + 1

    def span(e: dict) -> tuple[int, int]:
        first = max(0, int((e["ts"] - start) / bin_us))
        last = min(bins, int((e["ts"] + e["dur"] - start) / bin_us) + 1)
        return first, last

    busy = bytearray(bins)
    kernel_us = 0.0
    for e in complete:
        if e.get("cat") in GPU_CATEGORIES:
            first, last = span(e)
            if first < last:
                busy[first:last] = b"\x01" * (last - first)
                kernel_us += e["dur"]
    copies_us = sum(e["dur"] for e in complete if e.get("cat") == "gpu_memcpy")

    def paint(items: list[dict]) -> list[str]:
        labels = ["none"] * bins
        for e in sorted(items, key=lambda e: -e["dur"]):  # the longest first: inner ranges paint over outer ones
            first, last = span(e)
            if first < last:
                labels[first:last] = [e["name"]] * (last - first)
        return labels

    mine = [e for e in phases if (e["pid"], e["tid"]) == engine_tid]
    ops = [e for e in complete if e.get("cat") == "cpu_op" and (e["pid"], e["tid"]) == engine_tid]
    phase_of = paint(mine)
    op_of = paint(ops)
    idle_by_phase: Counter[str] = Counter()
    idle_by_op: Counter[tuple[str, str]] = Counter()
    wall_by_phase: Counter[str] = Counter()
    for i in range(bins):
        wall_by_phase[phase_of[i]] += 1
        if not busy[i]:
            idle_by_phase[phase_of[i]] += 1
            idle_by_op[(phase_of[i], op_of[i])] += 1
    window_ms = bins * bin_us / 1e3
    idle_ms = (bins - sum(busy)) * bin_us / 1e3
    to_ms = bin_us / 1e3
    step_ms = sorted(e["dur"] / 1e3 for e in steps)
    return {
        "window_ms": round(window_ms, 1),
        "steps": len(steps),
        "step_ms_p50": round(step_ms[len(step_ms) // 2], 2),
        "gpu_idle_ms": round(idle_ms, 1),
        "gpu_idle_share": round(idle_ms / window_ms, 3),
        "kernel_ms": round(kernel_us / 1e3, 1),
        "memcpy_ms": round(copies_us / 1e3, 1),
        "wall_ms_by_phase": {k: round(v * to_ms, 1) for k, v in wall_by_phase.most_common()},
        "idle_ms_by_phase": {k: round(v * to_ms, 1) for k, v in idle_by_phase.most_common()},
        "idle_ms_by_phase_op": [[p, o, round(v * to_ms, 1)] for (p, o), v in idle_by_op.most_common(40)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--bin-us", type=float, default=20.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = analyse(load(args.trace), args.bin_us)
    print(
        f"{result['steps']} steps in {result['window_ms']} ms (step p50 {result['step_ms_p50']} ms): GPU idle "
        f"{result['gpu_idle_ms']} ms ({result['gpu_idle_share']:.0%}); kernels {result['kernel_ms']} ms, "
        f"copies {result['memcpy_ms']} ms"
    )
    print("idle ms by phase (wall ms):")
    for name, ms in result["idle_ms_by_phase"].items():
        print(f"  {ms:9.1f}  {name}  ({result['wall_ms_by_phase'].get(name)})")
    print("idle ms by phase and op:")
    for name, op, ms in result["idle_ms_by_phase_op"][:30]:
        print(f"  {ms:9.1f}  {name} / {op}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
