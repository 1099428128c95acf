"""Where an agent step lost cache hits: each warm call of a load generator JSON that got fewer cached tokens than
the traces' own reuse (the optimum), joined with the rank's `finished request=` log line of the same call, which
says how many of its tokens came from L0 (the GPU pool) and how many from L1 (host memory).

A call short of its optimum with nothing from L1 lost its session from both tiers (L1's capacity, or its lookup
gave up); one with some L1 tokens had its restore cut (the tail was gone from L1, or there was no room in L0 for
the rest). The two need different fixes, which is why the split is worth printing.

    python bench/cache_losses.py RAW/ours-agents-40.json LOGS/rank-worker-0.log[.gz] [--json out.json]

The join is by prompt length and cached tokens (the log has no agent or turn); a call whose pair is not unique in
the log is still counted, its split reported as unknown."""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

FINISHED = re.compile(r"finished request=\S+ .*?prompt_tokens=(\d+) l0_cached_tokens=(\d+) l1_cached_tokens=(\d+)")
# a call short of its optimum by less than this is rounding: the optimum counts tokens, the engine whole blocks
MIN_SHORT = 256


def rank_splits(log_text: str) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(prompt tokens, cached tokens) -> the (L0, L1) splits of the rank's finished calls with that pair."""
    splits: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for match in FINISHED.finditer(log_text):
        prompt, l0, l1 = (int(group) for group in match.groups())
        splits[(prompt, l0 + l1)].append((l0, l1))
    return splits


def _warm_calls(loadgen: dict[str, Any]) -> list[dict[str, Any]]:
    return [call for call in loadgen["requests"] if call.get("warm") and not call.get("error")]


def _optimum(call: dict[str, Any]) -> int:
    """The tokens of the call's prompt the traces reuse (its expected_reuse is a fraction of the prompt)."""
    return round(call["expected_reuse"] * call["input_tokens"])


def losses(loadgen: dict[str, Any], splits: dict[tuple[int, int], list[tuple[int, int]]]) -> list[dict[str, Any]]:
    """The warm calls short of their optimum by MIN_SHORT tokens or more, largest loss first."""
    short = []
    for call in _warm_calls(loadgen):
        optimum = _optimum(call)
        lost = optimum - call["cached_tokens"]
        if lost < MIN_SHORT:
            continue
        found = splits.get((call["input_tokens"], call["cached_tokens"]), [])
        l0, l1 = found[0] if len(set(found)) == 1 else (None, None)
        short.append(
            {
                "agent": call["agent"],
                "turn": call["turn"],
                "sent_s": call["sent_s"],
                "input_tokens": call["input_tokens"],
                "optimum": optimum,
                "cached": call["cached_tokens"],
                "lost": lost,
                "l0": l0,
                "l1": l1,
            }
        )
    return sorted(short, key=lambda row: -row["lost"])


def kind(row: dict[str, Any]) -> str:
    if row["l1"] is None:
        return "unknown"
    if row["l1"] == 0:
        return "none from L1"
    return "restore cut"


def summary(loadgen: dict[str, Any], short: list[dict[str, Any]]) -> dict[str, Any]:
    warm = _warm_calls(loadgen)
    by_kind: dict[str, dict[str, int]] = {}
    for row in short:
        entry = by_kind.setdefault(kind(row), {"calls": 0, "lost": 0})
        entry["calls"] += 1
        entry["lost"] += row["lost"]
    return {
        "warm_calls": len(warm),
        "optimum_tokens": sum(_optimum(call) for call in warm),
        "short_calls": len(short),
        "lost_tokens": sum(row["lost"] for row in short),
        "by_kind": by_kind,
        "calls": short,
    }


def read_text(path: Path) -> str:
    """A log, plain or gzipped."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return handle.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("loadgen", type=Path, help="the load generator's JSON of one step")
    parser.add_argument("rank_log", type=Path, help="the rank worker's log (plain or .gz)")
    parser.add_argument("--json", type=Path, help="write the summary and every short call here")
    parser.add_argument("--top", type=int, default=10, help="calls to print, largest loss first")
    args = parser.parse_args(argv)
    loadgen = json.loads(args.loadgen.read_text())
    result = summary(loadgen, losses(loadgen, rank_splits(read_text(args.rank_log))))
    console = Console()
    console.print(
        f"{result['short_calls']} of {result['warm_calls']} warm calls short of their optimum: "
        f"{result['lost_tokens']:,} of {result['optimum_tokens']:,} tokens lost"
    )
    for name, entry in sorted(result["by_kind"].items()):
        console.print(f"  {name}: {entry['calls']} calls, {entry['lost']:,} tokens")
    table = Table("agent", "turn", "sent s", "prompt", "optimum", "cached", "L0", "L1", "lost")
    for row in result["calls"][: args.top]:
        table.add_row(
            *(str(row[key]) for key in ("agent", "turn", "sent_s", "input_tokens", "optimum", "cached")),
            *("?" if row[key] is None else str(row[key]) for key in ("l0", "l1")),
            str(row["lost"]),
        )
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
