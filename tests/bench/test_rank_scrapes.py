"""bench/rank_scrapes.py: the rank's counters per agent step, from the scrapes bench/peer_h200.sh writes."""

from __future__ import annotations

import json
from pathlib import Path

from bench.rank_scrapes import counters, step_amounts


def scrape(evicted: int, unsaved: int) -> str:
    labels = '{engine="rank-0",model_name="llama-8b-chat"}'
    return (
        "# HELP kvserve:l0_evicted_blocks_total L0 prefix-cache blocks evicted while L1 was attached.\n"
        "# TYPE kvserve:l0_evicted_blocks_total counter\n"
        f"kvserve:l0_evicted_blocks_total{labels} {evicted}.0\n"
        "# HELP kvserve:l0_evicted_unsaved_blocks_total L0 prefix-cache blocks evicted that L1 did not hold.\n"
        "# TYPE kvserve:l0_evicted_unsaved_blocks_total counter\n"
        f"kvserve:l0_evicted_unsaved_blocks_total{labels} {unsaved}.0\n"
        "# HELP kvserve:l1_attached 1 while the rank has the kvstore's L1 arena mapped.\n"
        "# TYPE kvserve:l1_attached gauge\n"
        f"kvserve:l1_attached{labels} 1.0\n"
    )


def test_counters_reads_the_named_counters_of_a_scrape() -> None:
    assert counters(scrape(40, 7)) == {"kvserve:l0_evicted_blocks": 40.0, "kvserve:l0_evicted_unsaved_blocks": 7.0}


def test_each_step_gets_its_own_amount_and_a_restart_counts_from_zero(tmp_path: Path) -> None:
    # 16 and 24 ran on one server; it was started again before 32 (its counters lower than 24's)
    for agents, (evicted, unsaved) in {16: (100, 10), 24: (250, 12), 32: (80, 5)}.items():
        (tmp_path / f"ours-agents-{agents}.rank-metrics.txt").write_text(scrape(evicted, unsaved))
    (tmp_path / "ours-agents-24.json").write_text("{}")  # not a scrape
    amounts = step_amounts(tmp_path)
    assert {n: a["kvserve:l0_evicted_blocks"] for n, a in amounts.items()} == {16: 100, 24: 150, 32: 80}
    assert {n: a["kvserve:l0_evicted_unsaved_blocks"] for n, a in amounts.items()} == {16: 10, 24: 2, 32: 5}


def test_steps_are_taken_in_the_order_they_ran_not_by_agent_count(tmp_path: Path) -> None:
    # STEPS=44,40 on one server: 44 ran first, so 40's amount is its scrape less 44's
    for agents, evicted, ended in ((44, 300, "2026-12-07T14:52:26Z"), (40, 550, "2026-12-07T14:54:00Z")):
        (tmp_path / f"ours-agents-{agents}.rank-metrics.txt").write_text(scrape(evicted, 0))
        (tmp_path / f"ours-agents-{agents}.json").write_text(json.dumps({"date": ended}))
    amounts = step_amounts(tmp_path)
    assert {n: a["kvserve:l0_evicted_blocks"] for n, a in amounts.items()} == {44: 300, 40: 250}
