"""The lockstep's wake-up of an idle rank, in a real expert-parallel group (gloo, its TCPStore) of one process."""

from __future__ import annotations

import threading
import time
from typing import Any

from ep_processes import run_group


def _wake_announced_before_the_loop(group: Any) -> dict[str, bool]:
    from rank_worker.expert_parallel.lockstep import Lockstep

    lockstep = Lockstep(group, exchange=None)  # the exchange is not used by the wake-up
    try:
        group.announce("go/0")  # a peer with work, while this rank is still building its engine loop
        deadline = time.monotonic() + 10
        while not lockstep.wants_step() and time.monotonic() < deadline:
            time.sleep(0.01)  # the wake thread's store wait answers: it sets the pending go
        seen = lockstep.wants_step()
        woken = threading.Event()
        lockstep.set_wake(woken.set)  # the engine loop comes up only now
        return {"seen": seen, "woken": woken.wait(5.0)}
    finally:
        lockstep.close()


def test_a_go_announced_before_the_engine_loop_exists_still_wakes_it() -> None:
    # Flaked 1 in ~8 in the 4-rank engine test: the rank with no work of its own slept through the group's first
    # agreement, and the others waited in it until the test gave up.
    [result] = run_group(_wake_announced_before_the_loop, 1)
    assert result == {"seen": True, "woken": True}
