"""Assemble the multi-rank results (issue 6) from the tarballs of bench/ranks_h200.sh: per run, the load
generator's steps, where the ranks ran, load per rank and stickiness from the gateway's request lines, and the
recovery of a rank killed mid-run; then the largest passing agent count of each placement against one rank's
(scaling_vs_one_rank when the ranks had a GPU each).

    python bench/ranks_results.py --raw DIR [--chart FILE.png]
DIR holds ranks-<phase>[-<label>].tgz files (phase: one, many or kill); runs of one phase and placement (one
rank; or the same GPU list) are taken together for their largest passing N. DIR is a run folder's raw/
(bench/ranks_h200.sh's OUT, e.g. bench/results/2026-11-29-h200-ranks/raw); the JSON goes beside it, to the run
folder's ranks.json, unless --out names another file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadgen.rank_balance import failover, parse_request_lines, rank_load, stickiness  # noqa: E402
from loadgen.report import largest_passing  # noqa: E402
from simulator.calibration import COMPARED  # noqa: E402

STEP_FIELDS = ("agents", "turns", *COMPARED, "expected_cache_hit", "cache_hit_l0", "cache_hit_l1", "failed", "passed")
PHASES = ("one", "many", "kill")


def unpack(tarball: Path, into: Path) -> Path:
    target = into / tarball.stem
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as archive:
        archive.extractall(target, filter="data")
    return target


def _text(path: Path, default: str = "") -> str:
    return path.read_text().strip() if path.is_file() else default


def _machine(gpu_names: str) -> str | None:
    """nvidia-smi's one line per GPU as "N x name" (what the machine had, not what the ranks used)."""
    names = gpu_names.splitlines()
    return f"{len(names)} x {names[0]}" if names else None


def run_result(run: Path, phase: str) -> dict[str, Any]:
    """One run: its load generator steps, its ranks and GPUs, and what the gateway's request lines say."""
    measured = json.loads((run / f"{phase}.json").read_text())
    ranks = int(_text(run / "ranks.txt", "1"))
    gpus = _text(run / "gpus.txt")
    placement = gpus.split(",")[:ranks] if gpus and phase != "one" else [str(index) for index in range(ranks)]
    gateway_log = run / f"logs-{phase}" / "gateway.log"
    served = parse_request_lines(gateway_log.read_text().splitlines()) if gateway_log.is_file() else []
    rank_ids = [f"rank-{index}" for index in range(ranks)]
    turns = measured.get("turns")
    result: dict[str, Any] = {
        "phase": phase,
        "ranks": ranks,
        "gpus": placement,
        "ranks_share_a_gpu": len(set(placement)) < len(placement),
        "gpu": _machine(_text(run / "gpu.txt")),
        "commit": _text(run / "commit.txt") or None,
        "date": measured.get("date"),
        "steps": [{key: ({**step, "turns": turns}).get(key) for key in STEP_FIELDS} for step in measured["steps"]],
        "largest_passing": measured.get("largest_passing"),
        "load": rank_load(served, rank_ids) if served else None,
        "stickiness": stickiness(served) if served else None,
    }
    killed = run / "killed_at.txt"
    if killed.is_file():
        dead = _text(run / "killed_rank.txt")
        result["failover"] = failover(served, dead, float(killed.read_text()))
        router_log = run / f"logs-{phase}" / "router.log"
        lines = router_log.read_text().splitlines() if router_log.is_file() else []
        result["failover"]["router_lines_about_it"] = [line for line in lines if dead in line][-6:]
    return result


def by_placement(runs: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped by where their ranks ran ("1 rank", "2 ranks on GPUs 0,0", ...)."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for run in runs.values():
        key = "1 rank" if run["ranks"] == 1 else f"{run['ranks']} ranks on GPUs {','.join(run['gpus'])}"
        grouped.setdefault(key, []).append(run)
    return grouped


def placements(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Runs of one placement taken together: their largest passing N over all their steps, and that against
    one rank's (a ratio for ranks sharing a GPU says what splitting it does, not what more GPUs add)."""
    summary: dict[str, dict[str, Any]] = {}
    for key, members in by_placement(runs).items():
        steps = [step for run in members for step in run["steps"]]
        summary[key] = {
            "ranks": members[0]["ranks"],
            "gpus": len(set(members[0]["gpus"])),
            "steps_run": sorted({(step["agents"], step["turns"]) for step in steps}),
            "largest_passing": largest_passing(steps),
        }
    one = summary.get("1 rank", {}).get("largest_passing")
    for entry in summary.values():
        many = entry["largest_passing"]
        entry["vs_one_rank"] = round(many / one, 2) if one and many else None
    return summary


def draw_chart(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Per-agent tok/s p50 against agents, one line per placement; filled markers: the step passed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, members in sorted(by_placement(runs).items()):
        steps = sorted((step for run in members for step in run["steps"]), key=lambda step: step["agents"])
        agents = [step["agents"] for step in steps]
        line = ax.plot(agents, [step["tok_s_p50"] for step in steps], "-", label=label)[0]
        for step in steps:
            face = line.get_color() if step["passed"] else "white"
            ax.plot(step["agents"], step["tok_s_p50"], "o", color=line.get_color(), markerfacecolor=face, markersize=8)
            if step["turns"] != 20:
                ax.annotate(f"{step['turns']} turns", (step["agents"], step["tok_s_p50"]), fontsize="small")
    ax.axhline(20, color="red", linestyle="--", linewidth=1, label="p50 bar")
    ax.set_xlabel("concurrent agents")
    ax.set_ylabel("output tokens/s per agent (p50)")
    ax.set_title("H200, llama-8b shape: filled = step passed every bar")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw", required=True)
    parser.add_argument("--out", default="", help="default: ranks.json in the run folder, beside --raw")
    parser.add_argument("--chart", default="", help="also draw tok/s per placement into this PNG (matplotlib)")
    parser.add_argument("--note", default="", help="what was and was not run, kept in the JSON")
    args = parser.parse_args()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for tarball in sorted(Path(args.raw).glob("ranks-*.tgz")):
            name = tarball.stem.removeprefix("ranks-")
            phase = name.split("-")[0]
            if phase in PHASES:
                runs[name] = run_result(unpack(tarball, Path(scratch)), phase)
    by_placement = placements(runs)
    four = [e for e in by_placement.values() if e["ranks"] == 4 and e["gpus"] == 4]
    result: dict[str, Any] = {
        "dates": sorted({run["date"] for run in runs.values() if run["date"]}),
        "commits": sorted({run["commit"] for run in runs.values() if run["commit"]}),
        "gpu": sorted({run["gpu"] for run in runs.values() if run["gpu"]}),
        "note": args.note,
        # The measure: four ranks with a GPU each against one rank; None until such a run exists.
        "scaling_vs_one_rank": four[0]["vs_one_rank"] if four else None,
        "placements": by_placement,
        "runs": runs,
    }
    out = Path(args.out) if args.out else Path(args.raw).parent / "ranks.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.chart:
        draw_chart(runs, Path(args.chart))
    print(json.dumps({"scaling_vs_one_rank": result["scaling_vs_one_rank"], "placements": by_placement}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
