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

# Event pairs in rotation: with decode steps pipelined (paged_engine.py) one step is read while the next runs,
# so a step's pair must outlive the launch of the one after it.
RING = 3


class GpuTimer:
    def __init__(self, device: torch.device) -> None:
        self._ring: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        if device.type == "cuda":
            self._ring = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(RING)
            ]
        self._next = 0
        self._last: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def start(self) -> None:
        if self._ring:
            self._ring[self._next][0].record()
            self._last = None

    def stop(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The span just timed (None on the CPU): pass it to span_s once its step has been read back."""
        if not self._ring:
            return None
        pair = self._ring[self._next]
        pair[1].record()
        self._next = (self._next + 1) % len(self._ring)
        self._last = pair
        return pair

    def last_span(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The span of the last stop (None on the CPU, or after start with no stop yet)."""
        return self._last

    def take_s(self) -> float | None:
        """Seconds between the last start and stop (None on the CPU or when nothing was timed since the last
        take). Call after the step's work is synchronised."""
        pair, self._last = self._last, None
        return span_s(pair)


def span_s(pair: tuple[torch.cuda.Event, torch.cuda.Event] | None) -> float | None:
    """A stopped span's GPU seconds (None for no span); waits for its end event if the GPU is not there yet."""
    if pair is None:
        return None
    begin, end = pair
    end.synchronize()  # already complete after the step's read-back: returns at once
    return begin.elapsed_time(end) / 1000.0
