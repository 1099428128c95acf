"""Assemble the multi-rank results (issue 6) from the tarballs of bench/ranks_h200.sh: the largest passing agent
count with one rank and with RANKS ranks (scaling_vs_one_rank, the ratio), load per rank and stickiness from
the gateway's request lines, and the recovery of a rank killed mid-run.

    python bench/ranks_results.py --raw DIR --out bench/results/four-gpus-h200.json
DIR holds ranks-one.tgz, ranks-many.tgz and ranks-kill.tgz (any of them may be missing).
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
from simulator.calibration import COMPARED  # noqa: E402

STEP_FIELDS = ("agents", *COMPARED, "cache_hit_l0", "cache_hit_l1", "failed")


def unpack(tarball: Path, into: Path) -> Path | None:
    if not tarball.is_file():
        return None
    target = into / tarball.stem
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as archive:
        archive.extractall(target, filter="data")
    return target


def phase(run: Path, name: str) -> dict[str, Any]:
    """One phase's load generator steps, its ranks, and what the gateway's request lines say."""
    measured = json.loads((run / f"{name}.json").read_text())
    ranks = int((run / "ranks.txt").read_text()) if (run / "ranks.txt").is_file() else 1
    gateway_log = run / f"logs-{name}" / "gateway.log"
    served = parse_request_lines(gateway_log.read_text().splitlines()) if gateway_log.is_file() else []
    rank_ids = [f"rank-{index}" for index in range(ranks)]
    gpus = (run / "gpus.txt").read_text().strip() if (run / "gpus.txt").is_file() else ""
    placement = gpus.split(",") if gpus else [str(index) for index in range(ranks)]
    result: dict[str, Any] = {
        "ranks": ranks,
        "gpus": placement if name != "one" else placement[:1],
        "ranks_share_a_gpu": len(set(placement)) < len(placement) and name != "one",
        "commit": (run / "commit.txt").read_text().strip() if (run / "commit.txt").is_file() else None,
        "steps": [{key: step.get(key) for key in STEP_FIELDS} for step in measured["steps"]],
        "largest_passing": measured.get("largest_passing"),
        "load": rank_load(served, rank_ids) if served else None,
        "stickiness": stickiness(served) if served else None,
    }
    killed = run / "killed_at.txt"
    if killed.is_file():
        dead = (run / "killed_rank.txt").read_text().strip()
        result["failover"] = failover(served, dead, float(killed.read_text()))
        router_log = run / f"logs-{name}" / "router.log"
        lines = router_log.read_text().splitlines() if router_log.is_file() else []
        result["failover"]["router_lines_about_it"] = [line for line in lines if dead in line][-6:]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    raw = Path(args.raw)
    result: dict[str, Any] = {"gpu": None}
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("one", "many", "kill"):
            run = unpack(raw / f"ranks-{name}.tgz", Path(scratch))
            if run is None:
                continue
            if result["gpu"] is None and (run / "gpu.txt").is_file():
                result["gpu"] = (run / "gpu.txt").read_text().strip() or "cpu"
            result[name] = phase(run, name)
    one = (result.get("one") or {}).get("largest_passing")
    many = (result.get("many") or {}).get("largest_passing")
    ratio = round(many / one, 2) if one and many else None
    if (result.get("many") or {}).get("ranks_share_a_gpu"):
        # Ranks sharing a GPU share its compute: their ratio says what splitting costs, not what GPUs add.
        result["scaling_vs_one_rank"] = None
        result["ratio_ranks_sharing_one_gpu"] = ratio
    else:
        result["scaling_vs_one_rank"] = ratio
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: v for k, v in result.items() if k in ("gpu", "scaling_vs_one_rank", "ratio_ranks_sharing_one_gpu")}
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
