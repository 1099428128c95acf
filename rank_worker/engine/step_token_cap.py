"""How many tokens a step may carry after one ran out of GPU memory.

The pool is sized by a probe of the engine's longest step (factory._profile_peak_bytes), so a step should never run
out; one still can (a shape the probe did not cover, another process on the GPU, the allocator's fragmentation),
and left alone it would fail every request in the engine. Nothing of a step counts until its tokens are read
(PagedEngine._advance), so a step whose launch runs out is dropped and scheduled again under a cap: half the
tokens of the step that failed. A transient shortage must not cost the rank its long steps for good, so after
`recovery_steps` steps that ran the cap doubles, and goes once it reaches the engine's own longest step; a shape
that runs out every time costs one dropped step per doubling, never a request.

The floor is one step of every seat's decode (max_num_seqs tokens): under it the scheduler would leave decoders
out. A step that runs out at the floor fails its own requests, which gives their blocks back; the rest go on."""

from __future__ import annotations

from dataclasses import dataclass

RECOVERY_STEPS = 500  # steps that ran under a cap before it doubles (seconds to minutes of serving)
MIN_WINDOW_SHARE = 8  # the prefill window shrinks with the cap down to longest_step // this


@dataclass
class StepTokenCap:
    longest_step: int  # the engine's own longest step: max_num_batched_tokens, or a solo prefill past it
    floor: int
    recovery_steps: int = RECOVERY_STEPS
    tokens: int | None = None  # the cap; None: none, the scheduler's own budget
    steps_under_cap: int = 0
    dropped_steps: int = 0  # cumulative: steps that ran out of memory and were scheduled again under a cap

    def lower(self, step_tokens: int) -> bool:
        """A step of step_tokens ran out of memory: cap the next ones at half of it (not under the floor). False,
        and no cap change, where that step was at the floor already: nothing smaller is left to try."""
        if step_tokens <= self.floor:
            return False
        self.tokens = max(self.floor, step_tokens // 2)
        self.steps_under_cap = 0
        self.dropped_steps += 1
        return True

    def ran(self) -> bool:
        """A step ran: True where that moved the cap up (doubled, or gone at the longest step)."""
        if self.tokens is None:
            return False
        self.steps_under_cap += 1
        if self.steps_under_cap < self.recovery_steps:
            return False
        self.steps_under_cap = 0
        doubled = 2 * self.tokens
        self.tokens = None if doubled >= self.longest_step else doubled
        return True

    def window(self) -> int:
        """The prefill window of a prefix-expanding attention (context_window_tokens): the longest step, or the
        cap where one holds, since a window's expansion is what the step's own tokens would cost; never under an
        eighth of the longest step (a long prefix would go in thousands of launches a layer). A window of at least
        the cap keeps a cold chunk, at most a step long, in one window (mla_windows.needs_windows)."""
        if self.tokens is None:
            return self.longest_step
        return min(max(self.tokens, self.longest_step // MIN_WINDOW_SHARE), self.longest_step)
