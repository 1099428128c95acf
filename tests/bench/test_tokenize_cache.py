"""bench/tokenize_cache.py on a small replay: it writes its result and chart, every call's ids agree with the whole
prompt's (it fails otherwise), and warm calls hit the segment cache."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "tests" / "loadgen" / "data" / "claude_code"


def _script():
    spec = importlib.util.spec_from_file_location("tokenize_cache", ROOT / "bench" / "tokenize_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_small_replay_writes_its_result_with_equal_ids(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    args = ["--traces", str(TRACES), "--agents", "1", "--turns", "4", "--context-scale", "0.05", "--out", str(out)]
    assert _script().main(args) == 0
    result = json.loads(out.read_text())
    assert result["provenance"]["commit"] and result["settings"]["turns"] == 4
    calls = result["calls"]
    assert [c["turn"] for c in calls] == [0, 1, 2, 3]
    assert all(c["messages"] >= 2 for c in calls) and calls[-1]["messages"] > calls[0]["messages"]
    assert result["summary"]["calls"] == 4 and out.with_suffix(".png").stat().st_size > 1000
