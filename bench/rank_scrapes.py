"""What the rank's /metrics said after each of ours's agent steps (bench/peer_h200.sh writes
ours-agents-N.rank-metrics.txt beside each step), as per-step amounts: the counters are the rank's since it started,
so each step's amount is its value less the previous step's, in the order the steps ran (by the `date` each step's
ours-agents-N.json records when it ended; STEPS=44,40 runs 44 first; without it, agent counts ascending); a counter
below its previous value means the stack was started again between them: that step's amounts are its values.

    python bench/rank_scrapes.py bench/results/2026-12-06-h100-peer-llama-8b-restored-first/raw
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

SCRAPE = re.compile(r"^ours-agents-(?P<agents>\d+)\.rank-metrics\.txt$")
# the L1 counters a step's cache hit is read against (rank_worker/metrics.py)
COUNTERS = (
    "kvserve:l0_evicted_blocks",
    "kvserve:l0_evicted_unsaved_blocks",
    "kvserve:l0_evicted_unsaved_in_flight_blocks",
    "kvserve:l0_evicted_unsaved_unoffered_blocks",
    "kvserve:l0_evicted_unsaved_past_held_blocks",
    "kvserve:l0_evicted_unsaved_no_slot_blocks",
    "kvserve:l1_fetch_timeouts",
    "kvserve:l1_restore_missing_blocks",
    "kvserve:l1_restore_room_cut_blocks",
    "kvserve:l1_restore_unstarted_blocks",
    "kvserve:l1_offer_refused_blocks",
    "kvserve:l1_offload_bytes",
    "kvserve:l1_restore_bytes",
    "kvserve:l1_room_waits",
)


def counters(text: str, names: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    """The named counters' values in one scrape (summed over label sets; absent: not reported)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in names:
            values[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return values


def ended_at(raw: Path, agents: int) -> str:
    """When the step of this many agents ended: its load generator JSON's `date` (ISO 8601, UTC, so it sorts as
    text); empty where that file or field is missing."""
    try:
        return str(json.loads((raw / f"ours-agents-{agents}.json").read_text()).get("date") or "")
    except (OSError, ValueError):
        return ""


def step_amounts(raw: Path, names: tuple[str, ...] = COUNTERS) -> dict[int, dict[str, float]]:
    """Per agent count, each counter's amount during that step."""
    found = [(int(m["agents"]), path) for path in raw.glob("*.rank-metrics.txt") if (m := SCRAPE.match(path.name))]
    scrapes = sorted((ended_at(raw, agents), agents, path) for agents, path in found)
    amounts: dict[int, dict[str, float]] = {}
    previous: dict[str, float] = {}
    for _, agents, path in scrapes:
        now = counters(path.read_text(), names)
        if any(value < previous.get(name, 0.0) for name, value in now.items()):
            previous = {}  # started again since the previous scrape: its counters began from zero
        amounts[agents] = {name: value - previous.get(name, 0.0) for name, value in now.items()}
        previous = now
    return amounts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, help="a run folder's raw files")
    args = parser.parse_args()
    print(json.dumps(step_amounts(args.raw), indent=1))


if __name__ == "__main__":
    main()
