"""BodyBudget alone: shares up to the capacity, first come first served, a bounded queue with a bounded wait,
and no share lost to a waiter that gives up (timed out or cancelled)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.http.body_budget import BodyBudget
from gateway.http.errors import BudgetRefused


def run(test: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(test())


async def settle() -> None:
    for _ in range(5):  # a grant wakes its waiter on the loop's next turns
        await asyncio.sleep(0)


def test_shares_within_the_capacity_are_taken_at_once() -> None:
    async def go() -> None:
        budget = BodyBudget(100, max_waiting=4, max_wait_s=5)
        assert await budget.acquire(60) == 60
        assert await budget.acquire(40) == 40
        assert budget.free_bytes == 0 and budget.waiting == 0
        budget.release(60)
        budget.release(40)
        assert budget.free_bytes == 100

    run(go)


def test_a_body_larger_than_the_budget_takes_all_of_it_and_goes_alone() -> None:
    async def go() -> None:
        budget = BodyBudget(100, max_waiting=4, max_wait_s=5)
        small = await budget.acquire(10)
        big = asyncio.create_task(budget.acquire(1000))
        await settle()
        assert not big.done() and budget.waiting == 1
        budget.release(small)
        assert await big == 100 and budget.free_bytes == 0

    run(go)


def test_waiters_are_served_in_arrival_order() -> None:
    async def go() -> None:
        budget = BodyBudget(100, max_waiting=4, max_wait_s=5)
        first = await budget.acquire(100)
        granted: list[str] = []

        async def wait(name: str, size: int) -> int:
            share = await budget.acquire(size)
            granted.append(name)
            return share

        large = asyncio.create_task(wait("large", 80))
        await settle()
        small = asyncio.create_task(wait("small", 10))  # would fit beside "large" but does not pass it
        await settle()
        budget.release(first)
        await asyncio.gather(large, small)
        assert granted == ["large", "small"] and budget.free_bytes == 10

    run(go)


def test_a_full_queue_refuses_at_once() -> None:
    async def go() -> None:
        budget = BodyBudget(100, max_waiting=1, max_wait_s=5)
        held = await budget.acquire(100)
        waiter = asyncio.create_task(budget.acquire(50))
        await settle()
        with pytest.raises(BudgetRefused, match="1 request bodies are already waiting"):
            await budget.acquire(50)
        budget.release(held)
        assert await waiter == 50

    run(go)


def test_no_queue_at_all_refuses_whenever_the_budget_is_short() -> None:
    async def go() -> None:
        budget = BodyBudget(100, max_waiting=0, max_wait_s=5)
        await budget.acquire(100)
        with pytest.raises(BudgetRefused):
            await budget.acquire(1)

    run(go)


def test_a_wait_that_runs_out_is_refused_and_lets_those_behind_it_in() -> None:
    async def go() -> None:
        budget = BodyBudget(100, max_waiting=4, max_wait_s=0.05)
        await budget.acquire(50)
        too_big = asyncio.create_task(budget.acquire(100))
        await settle()
        fits = asyncio.create_task(budget.acquire(50))  # behind too_big, though it would fit now
        await settle()
        assert not fits.done()
        with pytest.raises(BudgetRefused, match=r"within 0\.05 s"):
            await too_big
        assert await fits == 50 and budget.waiting == 0 and budget.free_bytes == 0

    run(go)


def test_a_cancelled_waiter_leaves_the_queue_and_loses_no_share() -> None:
    async def go() -> None:
        budget = BodyBudget(100, max_waiting=4, max_wait_s=5)
        held = await budget.acquire(100)
        waiter = asyncio.create_task(budget.acquire(60))
        await settle()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert budget.waiting == 0
        # Cancelled just as its share came: the share goes back, not lost
        late = asyncio.create_task(budget.acquire(60))
        await settle()
        budget.release(held)  # grants `late` its share; it has not run since
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        assert budget.free_bytes == 100 and budget.waiting == 0

    run(go)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        BodyBudget(0, max_waiting=1, max_wait_s=1)
    with pytest.raises(ValueError):
        BodyBudget(1, max_waiting=-1, max_wait_s=1)
    with pytest.raises(ValueError):
        BodyBudget(1, max_waiting=1, max_wait_s=0)
