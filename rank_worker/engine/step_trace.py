"""A torch.profiler timeline of some of the serving loop's iterations, for finding where the GPU waits on the host.

The step-timing log says a step's wall time and its forward's GPU time; when they differ, this says what the
host was doing meanwhile. Off unless KVSERVE_STEP_TRACE is set (a debugging aid of the benchmark scripts, not a
setting an operator tunes): "SKIP:COUNT:PATH" records iterations SKIP+1 .. SKIP+COUNT of the engine thread, CPU
ops and CUDA kernels, into the Chrome trace PATH (bench/probes/trace_gaps.py reads it); several such windows,
in order and apart, are separated by commas. The loop marks its phases (and the engine its own) with
`phase(name)`, which costs one global test while no trace is running.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "KVSERVE_STEP_TRACE"
_recording = False  # a trace is running in this process: phase() marks ranges


def phase(name: str) -> contextlib.AbstractContextManager[object]:
    """A named range on the trace's host timeline while one is recording; nothing otherwise."""
    if not _recording:
        return contextlib.nullcontext()
    import torch

    return torch.profiler.record_function(name)


def parse_spec(spec: str) -> list[tuple[int, int, Path]]:
    """'SKIP:COUNT:PATH[,SKIP:COUNT:PATH...]' -> [(skip, count, path)]; ValueError names what is wrong."""
    windows: list[tuple[int, int, Path]] = []
    for window in spec.split(","):
        parts = window.split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or not parts[2]:
            raise ValueError(f"{ENV} must be SKIP:COUNT:PATH (two whole numbers and a file), not {window!r}")
        skip, count = int(parts[0]), int(parts[1])
        if count <= 0:
            raise ValueError(f"{ENV}: COUNT must be at least 1, not {count}")
        if windows and skip < windows[-1][0] + windows[-1][1]:
            raise ValueError(f"{ENV}: the window {window!r} starts before the one ahead of it ends")
        windows.append((skip, count, Path(parts[2])))
    return windows


class StepTrace:
    """Counts the loop's iterations and profiles the chosen ones."""

    def __init__(self, spec: str | None = None) -> None:
        spec = os.environ.get(ENV, "") if spec is None else spec
        self._profiler = None
        self._windows = parse_spec(spec) if spec else []
        self._seen = 0

    @property
    def active(self) -> bool:
        return self._profiler is not None

    @property
    def done(self) -> bool:
        return not self._windows and not self.active

    def tick(self) -> None:
        """Called once per loop iteration, before its step."""
        if self.done:
            return
        self._seen += 1
        skip, count, path = self._windows[0]
        if self.active and self._seen == skip + count + 1:
            self._stop(path)
            self._windows.pop(0)
            if not self._windows:
                return
            skip, count, path = self._windows[0]
        if not self.active and self._seen == skip + 1:
            self._start(count, path)

    def close(self) -> None:
        if self.active:
            self._stop(self._windows.pop(0)[2])
        self._windows = []

    def _start(self, count: int, path: Path) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        _set_recording(True)
        log.info("step trace: recording %d iterations into %s", count, path)

    def _stop(self, path: Path) -> None:
        profiler, self._profiler = self._profiler, None
        _set_recording(False)
        assert profiler is not None, "stopped while not recording"
        profiler.__exit__(None, None, None)
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        log.info("step trace: wrote %s", path)


def _set_recording(on: bool) -> None:
    global _recording
    _recording = on
