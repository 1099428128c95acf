"""A byte budget for the request bodies the gateway reads and parses at once.

A body's objects take many times its size (a 32 MB body of a million tiny content blocks took 1.1 GB once
parsed and validated), and parsing one at a time bounds only the CPU: four such bodies at once held 3.3 GB.
So a body takes a share of this budget before it is read (its size, capped at the whole budget so that any
body can go alone), and later ones wait their turn in a bounded first-come queue, each for a bounded time."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from gateway.http.errors import BudgetRefused


@dataclass
class _Waiter:
    share: int
    granted: asyncio.Future[None]


class BodyBudget:
    def __init__(self, capacity_bytes: int, max_waiting: int, max_wait_s: float) -> None:
        if capacity_bytes <= 0 or max_waiting < 0 or max_wait_s <= 0:
            raise ValueError("capacity_bytes and max_wait_s must be positive, max_waiting not negative")
        self.capacity_bytes = capacity_bytes
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.free_bytes = capacity_bytes
        self._waiting: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, body_bytes: int) -> int:
        """The share taken for a body of `body_bytes` (give it back with release); BudgetRefused when the queue
        is full or the share did not come within max_wait_s."""
        share = min(body_bytes, self.capacity_bytes)
        if not self._waiting and share <= self.free_bytes:
            self.free_bytes -= share
            return share
        if len(self._waiting) >= self.max_waiting:
            raise BudgetRefused(f"{len(self._waiting)} request bodies are already waiting to be read")
        waiter = _Waiter(share, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        try:
            # asyncio.wait, not wait_for: a timeout must not cancel a share granted at the same moment
            await asyncio.wait([waiter.granted], timeout=self.max_wait_s)
        except BaseException:  # this task was cancelled while it waited
            self._leave(waiter)
            raise
        if not waiter.granted.done():
            self._leave(waiter)
            raise BudgetRefused(f"no room to read the body within {self.max_wait_s:g} s")
        return share

    def release(self, share: int) -> None:
        self.free_bytes += share
        self._grant()

    def _leave(self, waiter: _Waiter) -> None:
        if waiter.granted.done():  # granted as it gave up: hand the share on
            self.release(waiter.share)
            return
        self._waiting.remove(waiter)
        waiter.granted.cancel()
        self._grant()  # the head may have left: those behind it may fit now

    def _grant(self) -> None:
        # First come, first served: a small body does not pass a large one that waits for room.
        while self._waiting and self._waiting[0].share <= self.free_bytes:
            waiter = self._waiting.popleft()
            self.free_bytes -= waiter.share
            waiter.granted.set_result(None)
