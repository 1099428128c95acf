"""GpuTimer: the GPU's own time between two points of a step, and nothing on the CPU."""

from __future__ import annotations

import time

import pytest
import torch

from rank_worker.engine.gpu_timer import GpuTimer


def test_on_the_cpu_there_is_nothing_to_time() -> None:
    timer = GpuTimer(torch.device("cpu"))
    timer.start()
    timer.stop()
    assert timer.take_s() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_times_the_kernels_between_start_and_stop_once() -> None:
    device = torch.device("cuda")
    timer = GpuTimer(device)
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    assert timer.take_s() is None  # nothing timed yet
    wall = time.perf_counter()
    timer.start()
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    timer.stop()
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    gpu = timer.take_s()
    assert gpu is not None and 0 < gpu <= wall * 1.05
    assert timer.take_s() is None  # taken: the next read needs a new start/stop
