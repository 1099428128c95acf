"""simulator/decode_probe.py runs against the engine as it is (a CPU smoke run on the tiny shape): the probe that
calibrates the simulator's decode model on the GPU must not find out it broke there."""

from __future__ import annotations

import json
from pathlib import Path

from simulator import decode_probe


def test_the_decode_probe_measures_every_quick_case_and_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    decode_probe.main(["--quick", "--shape", "tiny", "--steps", "2", "--num-blocks", "64", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(row["batch"], row["prefill_new"]) for row in rows] == [(2, 0), (4, 0), (1, 128)]
    assert all(row["step_ms"] > 0 and row["model_ms"] > 0 for row in rows)
    assert result["shape"] == "tiny"


def test_a_case_larger_than_the_pool_is_skipped_not_fatal(tmp_path: Path) -> None:
    """On an H100 the probe runs on our pool (25,800 blocks of llama-8b), too small for its 524K-token cases."""
    out = tmp_path / "decode.json"
    decode_probe.main(["--quick", "--shape", "tiny", "--steps", "2", "--num-blocks", "20", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(row["batch"], row["max_context"]) for row in rows] == [(2, 64)]  # 4 x 256 and the prefill do not fit


def test_cases_of_more_sequences_in_all_than_table_rows_run(tmp_path: Path, monkeypatch) -> None:
    """Each case's sequences give their block-table rows back (on the H100 the full set ran out of rows at the
    sixth case: 266 sequences against max_num_seqs 256)."""
    monkeypatch.setattr(decode_probe, "CASES", [([32] * 200, None), ([32] * 100, None)])
    out = tmp_path / "decode.json"
    decode_probe.main(["--shape", "tiny", "--steps", "1", "--num-blocks", "1600", "--out", str(out)])
    assert [row["batch"] for row in json.loads(out.read_text())["rows"]] == [200, 100]


def test_the_probes_engine_runs_a_prefill_chunk_whole_beside_decoders() -> None:
    """No decode step budget (on a GPU the default 40 ms cut the probe's 8K chunk beside 16 decoders)."""
    engine = decode_probe._engine("tiny", 64, 512)
    assert engine.settings.scheduling.decode_step_budget_ms == 0.0
