"""bench/cache_losses.py: the join of a load generator step with the rank's log, and the split of what was lost."""

from __future__ import annotations

import gzip
import json

from bench import cache_losses


def _call(agent, turn, input_tokens, reuse, cached, warm=True):
    return {
        "agent": agent,
        "turn": turn,
        "sent_s": float(turn),
        "warm": warm,
        "expected_reuse": reuse / input_tokens,
        "input_tokens": input_tokens,
        "cached_tokens": cached,
        "error": None,
    }


def _line(prompt, l0, l1):
    return (
        f"2026-12-06 12:27:07,948 INFO rank_worker.servicer: finished request=chatcmpl-x reason=length "
        f"prompt_tokens={prompt} l0_cached_tokens={l0} l1_cached_tokens={l1} output_tokens=64 queue_ms=2.5\n"
    )


STEP = {
    "requests": [
        _call(0, 1, 10_000, 9_000, 9_000),  # whole: not short
        _call(1, 2, 20_000, 19_000, 3_000),  # restore cut: 3,000 from L1
        _call(2, 3, 30_000, 29_000, 1_024),  # none from L1: 1,024 from L0
        _call(3, 0, 5_000, 0, 0, warm=False),  # cold: never counted
        _call(4, 4, 40_000, 39_000, 38_900),  # short by less than a rounding: not counted
    ]
}
LOG = _line(10_000, 9_000, 0) + _line(20_000, 0, 3_000) + _line(30_000, 1_024, 0) + _line(5_000, 0, 0)


def test_short_calls_are_split_by_what_l1_gave_largest_loss_first():
    result = cache_losses.summary(STEP, cache_losses.losses(STEP, cache_losses.rank_splits(LOG)))
    assert [(row["agent"], row["lost"], row["l0"], row["l1"]) for row in result["calls"]] == [
        (2, 27_976, 1_024, 0),
        (1, 16_000, 0, 3_000),
    ]
    assert result["by_kind"] == {
        "none from L1": {"calls": 1, "lost": 27_976},
        "restore cut": {"calls": 1, "lost": 16_000},
    }
    assert result["warm_calls"] == 4 and result["short_calls"] == 2 and result["lost_tokens"] == 43_976


def test_a_pair_the_log_has_twice_with_different_splits_is_unknown():
    log = LOG + _line(20_000, 1_000, 2_000)
    rows = cache_losses.losses(STEP, cache_losses.rank_splits(log))
    assert {row["agent"]: (row["l0"], row["l1"]) for row in rows} == {1: (None, None), 2: (1_024, 0)}
    assert cache_losses.kind(rows[1]) == "unknown"


def test_the_command_reads_a_gzipped_log_and_writes_the_summary(tmp_path, capsys):
    step, log, out = tmp_path / "step.json", tmp_path / "rank.log.gz", tmp_path / "out.json"
    step.write_text(json.dumps(STEP))
    with gzip.open(log, "wt") as handle:
        handle.write(LOG)
    assert cache_losses.main([str(step), str(log), "--json", str(out)]) == 0
    assert "2 of 4 warm calls short of their optimum: 43,976" in capsys.readouterr().out
    assert json.loads(out.read_text())["by_kind"]["restore cut"]["calls"] == 1
