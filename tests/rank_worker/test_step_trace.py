"""KVSERVE_STEP_TRACE: the serving loop's chosen iterations recorded with torch.profiler, phases marked, and
bench/probes/trace_gaps.py's account of them; a malformed spec is refused with what is wrong."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import torch

from bench.probes import trace_gaps
from rank_worker.engine import step_trace
from rank_worker.engine.step_trace import StepTrace, parse_spec, phase


def _iteration() -> None:
    with phase("engine.step"):
        with phase("launch"):
            torch.randn(64, 64) @ torch.randn(64, 64)
        with phase("read"):
            time.sleep(0.003)
    with phase("loop.deliver"):
        time.sleep(0.001)


def test_the_chosen_windows_are_recorded_and_accounted_for(tmp_path: Path) -> None:
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    trace = StepTrace(f"2:3:{first},7:2:{second}")
    for i in range(12):
        trace.tick()
        assert trace.active == (2 <= i < 5 or 7 <= i < 9)
        _iteration()
    trace.close()
    assert not step_trace._recording  # phase() is a no-op again
    for path, steps in ((first, 3), (second, 2)):
        result = trace_gaps.analyse(trace_gaps.load(path), bin_us=20.0)
        assert result["steps"] == steps
        # no GPU here: every bin is idle, and the phases account for the window between them
        assert result["gpu_idle_share"] == 1.0
        assert result["idle_ms_by_phase"]["read"] >= steps * 3 * 0.9
        assert {"launch", "read", "loop.deliver"} <= set(result["idle_ms_by_phase"])


def test_a_loop_closed_mid_window_still_writes_its_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    trace = StepTrace(f"0:100:{path}")
    trace.tick()
    _iteration()
    trace.close()
    assert path.is_file() and trace.done and not step_trace._recording


def test_without_the_variable_nothing_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(step_trace.ENV, raising=False)
    trace = StepTrace()
    trace.tick()
    assert trace.done and not trace.active
    assert isinstance(phase("x"), contextlib.nullcontext)  # not a profiler range


@pytest.mark.parametrize("spec", ["10:5", "a:5:/tmp/x", "10:0:/tmp/x", "5:10:/tmp/a,8:2:/tmp/b"])
def test_a_malformed_spec_says_what_is_wrong(spec: str) -> None:
    with pytest.raises(ValueError, match="KVSERVE_STEP_TRACE"):
        parse_spec(spec)
