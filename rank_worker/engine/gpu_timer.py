"""The GPU's own time for one step's forward, beside the step's wall time.

Under load a decode step in the serving process can take longer than the same step in a bare engine
benchmark; the difference is host work (scheduling, inputs, outputs, delivery, the gRPC threads' share of
the GIL) or the GPU itself. Two CUDA events around the forward's launch tell them apart: they are recorded
on the stream, so their distance is what the GPU spent from the first kernel of the forward to its last
(for a graph replay, its kernels alone; for an eager forward, also any gap where the GPU waited for the
host to launch). Read only after the step has synchronised (sampling reads the tokens back), so it adds no
wait. On the CPU there is nothing to time: `take_s` is None.
"""

from __future__ import annotations

import torch


class GpuTimer:
    def __init__(self, device: torch.device) -> None:
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._recorded = False

    def start(self) -> None:
        if self._events is not None:
            self._events[0].record()
            self._recorded = False

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
            self._recorded = True

    def take_s(self) -> float | None:
        """Seconds between the last start and stop (None on the CPU or when nothing was timed since the last
        take). Call after the step's work is synchronised."""
        if self._events is None or not self._recorded:
            return None
        self._recorded = False
        begin, end = self._events
        end.synchronize()  # already complete after the step's read-back: returns at once
        return begin.elapsed_time(end) / 1000.0
