"""The ranks of an expert-parallel group step together: a MoE layer is a collective, so every rank runs a
forward whenever any rank does, with the same exchanges.

Each launch (a rank's real step, or an empty one when it has nothing) begins with an agreement over the control
group: the largest step's tokens, whether every rank's step is decode-only, and whether any rank still has work.
From it every rank derives the same choices: the MoE exchange plan (StepPlan), or the decode-graph bucket when
every rank decodes (a rank with nothing replays that bucket's graph over padding rows), or no forward at all when
no rank has tokens.

An idle group (no rank with work) does not step: its ranks sleep in their engine loops. A rank that gets work
announces it in the group's store (`go/<epoch>`) before its agreement; the other ranks' wake threads block on
that key (the store answers when it is set: no spinning) and wake their loops, which then step with it. The
group goes idle again, every rank at the same agreement, when none has work, and the epoch moves on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rank_worker.expert_parallel.exchange import ExpertExchange, StepPlan
from rank_worker.expert_parallel.group import WAKE_WAIT_S, ExpertGroup


@dataclass(frozen=True)
class GroupStep:
    """What a group agreed for one forward."""

    tokens: int  # the largest step's tokens (a decode step: its rows)
    all_decode: bool  # every rank's step is decode-only (or empty): the decode graphs may replay
    busy: bool  # some rank still has work: the group steps again

    def plan(self, chunk: int) -> StepPlan:
        return StepPlan.for_tokens(self.tokens, chunk)


class Lockstep:
    def __init__(self, group: ExpertGroup, exchange: ExpertExchange) -> None:
        self.group = group
        self.exchange = exchange
        self.steps = 0  # agreements made
        self.empty_steps = 0  # forwards of padding only, for another rank's work
        self._cond = threading.Condition()
        self._active = False  # the last agreement said some rank has work
        self._go_pending = False  # a peer announced work while this rank was idle
        self._epoch = 0  # idle periods so far; `go/<epoch>` wakes the group out of the current one
        self._wake: Callable[[], None] | None = None
        self._stopped = threading.Event()
        self._waker = threading.Thread(target=self._wait_for_peers, name="ep-wake", daemon=True)
        self._waker.start()

    def set_wake(self, wake: Callable[[], None]) -> None:
        """The engine loop's wake-up, called when a peer announces work while this rank is idle. A peer may have
        announced before this rank's loop existed (it was still building its engine): the wake thread saw the
        key with no one to wake, so the loop is woken now, or it would sleep while the group waits for it."""
        with self._cond:
            self._wake = wake
            pending = self._go_pending
        if pending:
            wake()

    def wants_step(self) -> bool:
        """Whether this rank must step although it has nothing of its own: the group is working."""
        with self._cond:
            return self._active or self._go_pending

    def agree(self, tokens: int, decode_only: bool, busy: bool) -> GroupStep:
        """This rank's step (tokens, decode-only, work left) against the group's: every rank gets the same."""
        with self._cond:
            idle, epoch = not self._active, self._epoch
        if idle:
            self.group.announce(f"go/{epoch}")  # the peers may be asleep: wake them for this agreement
        mine = torch.tensor([tokens, 0 if decode_only else 1, 1 if busy or tokens else 0], dtype=torch.int64)
        agreed = self.group.all_reduce_max(mine).tolist()
        step = GroupStep(tokens=int(agreed[0]), all_decode=agreed[1] == 0, busy=agreed[2] == 1)
        self.steps += 1
        with self._cond:
            self._go_pending = False
            self._active = step.busy
            if not step.busy:
                self._epoch += 1  # every rank at this same agreement: the next wake-up is go/<epoch + 1>
                self._cond.notify_all()
        return step

    def _wait_for_peers(self) -> None:
        """Wake thread: while idle, block on the current epoch's go key; on it, wake the engine loop."""
        while not self._stopped.is_set():
            with self._cond:
                epoch = self._epoch
            if not self.group.wait_for(f"go/{epoch}", WAKE_WAIT_S, waker=True):
                if self.group.is_broken:
                    return
                continue
            with self._cond:
                wake = self._epoch == epoch and not self._active
                if wake:
                    self._go_pending = True
            if wake and self._wake is not None:
                self._wake()
            with self._cond:  # the key stays set: wait for the next idle period before waiting on the store again
                while self._epoch == epoch and not self._stopped.is_set():
                    self._cond.wait()

    def close(self) -> None:
        self._stopped.set()
        with self._cond:
            self._cond.notify_all()
        # not joined: it may be inside a store wait of its own (up to WAKE_WAIT_S); a daemon, it ends with the process
