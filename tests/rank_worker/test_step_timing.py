"""Step timing: the summary the engine loop logs (step time by kind, busy share, loop overhead)."""

from __future__ import annotations

import pytest

from rank_worker.step_timing import StepTiming


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_summary_splits_decode_and_prefill_steps_and_counts_overhead() -> None:
    clock = FakeClock()
    timing = StepTiming(clock=clock)
    for _ in range(8):
        timing.record(step_s=0.010, iteration_s=0.011, num_tokens=4, prefill_tokens=0)
    for _ in range(2):
        timing.record(step_s=0.050, iteration_s=0.052, num_tokens=516, prefill_tokens=512)
    clock.now += 1.0
    summary = timing.take()
    assert summary.steps == 10 and summary.decode_only_steps == 8
    assert summary.decode_step_ms_p50 == pytest.approx(10.0)
    assert summary.mixed_step_ms_p50 == pytest.approx(50.0)
    assert summary.step_ms_p95 == pytest.approx(50.0)
    assert summary.busy_fraction == pytest.approx(0.18)  # 8 x 10 ms + 2 x 50 ms in one second
    assert summary.overhead_ms_per_step == pytest.approx((8 * 1.0 + 2 * 2.0) / 10)
    assert summary.tokens_per_step == pytest.approx((8 * 4 + 2 * 516) / 10)
    assert "decode-only 8 at 10.0 ms" in summary.describe()


def test_take_starts_a_new_window() -> None:
    clock = FakeClock()
    timing = StepTiming(clock=clock)
    timing.record(0.02, 0.02, 1, 0)
    clock.now += 5.0
    timing.take()
    assert timing.steps == 0 and timing.elapsed() == 0.0
    clock.now += 2.0
    empty = timing.take()
    assert empty.steps == 0 and empty.window_s == pytest.approx(2.0) and empty.busy_fraction == 0.0


def test_gpu_time_is_reported_beside_each_kinds_wall_time_where_measured() -> None:
    clock = FakeClock()
    timing = StepTiming(clock=clock)
    for gpu in (0.006, 0.007, 0.008):  # decode steps of 10 ms wall, 6-8 ms on the GPU: host-bound by ~3 ms
        timing.record(step_s=0.010, iteration_s=0.010, num_tokens=8, prefill_tokens=0, gpu_s=gpu)
    timing.record(step_s=0.040, iteration_s=0.040, num_tokens=520, prefill_tokens=512, gpu_s=0.038)
    clock.now += 1.0
    summary = timing.take()
    assert summary.decode_gpu_ms_p50 == pytest.approx(7.0)
    assert summary.mixed_gpu_ms_p50 == pytest.approx(38.0)
    text = summary.describe()
    assert "at 10.0 ms p50 (GPU 7.0 ms)" in text and "at 40.0 ms p50 (GPU 38.0 ms)" in text
    # the next window starts empty; a window with no GPU timing (the CPU) says nothing about the GPU
    timing.record(step_s=0.010, iteration_s=0.010, num_tokens=8, prefill_tokens=0)
    clock.now += 1.0
    bare = timing.take()
    assert bare.decode_gpu_ms_p50 is None and bare.mixed_gpu_ms_p50 is None and "GPU" not in bare.describe()
