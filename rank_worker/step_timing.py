"""Where the engine thread's time goes: engine steps (by kind) against everything else the loop does.

An operator asking "why is decode slow under load" needs the step time the engine actually achieves in
the serving process, which can differ from a bare engine benchmark (GIL contention with the gRPC
threads, L1 bookkeeping, delivery to streams). The loop records every iteration here and logs a summary
line at a fixed interval; the same summary is kept for the Stats RPC and tests. Where the engine can time
its forward on the GPU (CUDA events: Engine.last_step_gpu_s), each kind's p50 comes with the GPU's p50
beside it: a step whose wall time is well above its GPU time is waiting on the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepTimingSummary:
    window_s: float
    steps: int
    decode_only_steps: int
    busy_fraction: float  # share of the window spent inside engine.step()
    step_ms_p50: float
    step_ms_p95: float
    decode_step_ms_p50: float  # steps that carried no prefill tokens
    mixed_step_ms_p50: float  # steps with prefill tokens (possibly alongside decodes)
    overhead_ms_per_step: float  # loop work outside engine.step() per iteration that stepped
    tokens_per_step: float
    decode_gpu_ms_p50: float | None = None  # the GPU's own time for those steps' forwards (None: not timed)
    mixed_gpu_ms_p50: float | None = None

    def describe(self) -> str:
        return (
            f"{self.steps} steps in {self.window_s:.1f} s (busy {self.busy_fraction:.0%}): step "
            f"{self.step_ms_p50:.1f} ms p50 / {self.step_ms_p95:.1f} ms p95; decode-only {self.decode_only_steps} "
            f"at {self.decode_step_ms_p50:.1f} ms p50{_gpu(self.decode_gpu_ms_p50)}, with prefill "
            f"{self.steps - self.decode_only_steps} at {self.mixed_step_ms_p50:.1f} ms p50"
            f"{_gpu(self.mixed_gpu_ms_p50)}; {self.tokens_per_step:.1f} tokens/step; loop overhead "
            f"{self.overhead_ms_per_step:.2f} ms/step"
        )


def _gpu(ms: float | None) -> str:
    return "" if ms is None else f" (GPU {ms:.1f} ms)"


def _p(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@dataclass
class StepTiming:
    """Accumulates one window of iterations; `take` returns its summary and starts the next window."""

    clock: object = time.perf_counter
    _started: float = field(default=0.0, init=False)
    _decode_ms: list[float] = field(default_factory=list, init=False)
    _mixed_ms: list[float] = field(default_factory=list, init=False)
    _overhead_s: float = field(default=0.0, init=False)
    _tokens: int = field(default=0, init=False)
    _decode_gpu_ms: list[float] = field(default_factory=list, init=False)
    _mixed_gpu_ms: list[float] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._started = self.clock()  # type: ignore[operator]

    def record(
        self, step_s: float, iteration_s: float, num_tokens: int, prefill_tokens: int, gpu_s: float | None = None
    ) -> None:
        """One loop iteration that stepped the engine: the step's own time and the whole iteration's, and the
        GPU's time for its forward where the engine measured it."""
        (self._mixed_ms if prefill_tokens else self._decode_ms).append(step_s * 1000.0)
        if gpu_s is not None:
            (self._mixed_gpu_ms if prefill_tokens else self._decode_gpu_ms).append(gpu_s * 1000.0)
        self._overhead_s += max(0.0, iteration_s - step_s)
        self._tokens += num_tokens

    @property
    def steps(self) -> int:
        return len(self._decode_ms) + len(self._mixed_ms)

    def elapsed(self) -> float:
        return self.clock() - self._started  # type: ignore[operator]

    def take(self) -> StepTimingSummary:
        window = max(self.elapsed(), 1e-9)
        every = sorted(self._decode_ms + self._mixed_ms)
        steps = len(every)
        summary = StepTimingSummary(
            window_s=window,
            steps=steps,
            decode_only_steps=len(self._decode_ms),
            busy_fraction=min(1.0, sum(every) / 1000.0 / window),
            step_ms_p50=_p(every, 0.5),
            step_ms_p95=_p(every, 0.95),
            decode_step_ms_p50=_p(sorted(self._decode_ms), 0.5),
            mixed_step_ms_p50=_p(sorted(self._mixed_ms), 0.5),
            overhead_ms_per_step=self._overhead_s * 1000.0 / steps if steps else 0.0,
            tokens_per_step=self._tokens / steps if steps else 0.0,
            decode_gpu_ms_p50=_p(sorted(self._decode_gpu_ms), 0.5) if self._decode_gpu_ms else None,
            mixed_gpu_ms_p50=_p(sorted(self._mixed_gpu_ms), 0.5) if self._mixed_gpu_ms else None,
        )
        self._started = self.clock()  # type: ignore[operator]
        self._decode_ms, self._mixed_ms, self._overhead_s, self._tokens = [], [], 0.0, 0
        self._decode_gpu_ms, self._mixed_gpu_ms = [], []
        return summary
