"""Waiting for a rank to come back when none can take a request now. A rank that dies or hangs (or a whole
expert-parallel group, whose ranks fail and restart together) is restarted by its supervisor, a new
incarnation at the same address: a stream it cut, or a request that came meanwhile, waits for it for
rank_recovery_wait_secs instead of failing at once.

A rank that failed a request stays out of that request's choices until it says SERVING on its health service
again (restarted and loaded, or resumed): a dead or hung rank is not sent the request while it is away. One
probe of an address at a time serves every request waiting on it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

FIRST_RETRY_S = 0.25  # the first look again; each next one twice as long after the last, up to MAX_RETRY_S
MAX_RETRY_S = 0.5
PROBE_TIMEOUT_S = 1.0  # a hung rank answers no probe; a dead one is waited for this long to accept a connection
ANY_RANK_EVERY_S = 2.0  # with none of its failed ranks back, a request still asks the chooser this often (a new rank)

Probe = Callable[[str, float], Awaitable[bool]]  # (address, timeout_s) -> whether the rank serves


class FailedRanks:
    """The ranks that failed one request and are not known to be back: rank_id -> address."""

    def __init__(self, ranks: dict[str, str] | None = None) -> None:
        self._ranks: dict[str, str] = dict(ranks or {})

    def add(self, rank_id: str, address: str) -> None:
        self._ranks[rank_id] = address

    def update(self, ranks: dict[str, str]) -> None:
        self._ranks.update(ranks)

    def avoid(self) -> set[str]:
        """Ids and addresses both: without its router, the gateway names a rank by its address."""
        return set(self._ranks) | set(self._ranks.values())

    def addresses(self) -> set[str]:
        return set(self._ranks.values())

    def back(self, addresses: Iterable[str]) -> None:
        """These serve again: the request may go to them."""
        gone = set(addresses)
        self._ranks = {rank_id: address for rank_id, address in self._ranks.items() if address not in gone}

    def __len__(self) -> int:
        return len(self._ranks)


class RankRevivals:
    """Whether ranks serve again, shared by every waiting request of a gateway: one probe of an address at a
    time, its answer reused for reuse_s, so a thousand streams cut by one group restart probe it as one."""

    def __init__(self, probe: Probe, reuse_s: float = FIRST_RETRY_S) -> None:
        self._probe = probe
        self._reuse_s = reuse_s
        self._in_flight: dict[str, asyncio.Task[bool]] = {}
        self._answers: dict[str, tuple[float, bool]] = {}  # address -> (when, serving)

    async def serving(self, address: str) -> bool:
        answer = self._answers.get(address)
        if answer is not None and time.monotonic() - answer[0] < self._reuse_s:
            return answer[1]
        task = self._in_flight.get(address)
        if task is None:
            task = self._in_flight[address] = asyncio.get_running_loop().create_task(
                self._probe(address, PROBE_TIMEOUT_S)
            )
            task.add_done_callback(lambda done: self._settle(address, done))
        return await asyncio.shield(task)  # one waiter leaving does not cancel the others' probe

    async def back_among(self, addresses: Iterable[str]) -> set[str]:
        """Those of `addresses` that serve now."""
        ordered = sorted(addresses)
        answers = await asyncio.gather(*(self.serving(address) for address in ordered))
        return {address for address, serving in zip(ordered, answers, strict=True) if serving}

    def _settle(self, address: str, task: asyncio.Task[bool]) -> None:
        self._in_flight.pop(address, None)
        if not task.cancelled() and task.exception() is None:
            self._answers[address] = (time.monotonic(), task.result())


async def until_a_rank_takes_it(
    attempt: Callable[[set[str]], Awaitable[T]],
    failed: FailedRanks,
    revivals: RankRevivals,
    wait_s: float,
    refusal: Exception,
    retry_on: tuple[type[Exception], ...],
) -> T:
    """attempt(avoid) again, once one of the `failed` ranks serves again (and every ANY_RANK_EVERY_S anyway),
    until it returns. `refusal` is why no rank could take it just now; the last refusal (one of `retry_on`)
    is raised once wait_s has passed. An attempt keeps `failed` up to date with the ranks that refused it."""
    deadline = time.monotonic() + wait_s
    retry_s = FIRST_RETRY_S
    last_attempt = time.monotonic()
    while True:
        looked = time.monotonic()
        back = await revivals.back_among(failed.addresses())
        failed.back(back)
        if back or looked - last_attempt >= ANY_RANK_EVERY_S:
            last_attempt = looked
            try:
                return await attempt(failed.avoid())
            except retry_on as exc:
                refusal = exc
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise refusal
        await asyncio.sleep(min(max(retry_s - (time.monotonic() - looked), 0.0), remaining))
        retry_s = min(retry_s * 2, MAX_RETRY_S)
