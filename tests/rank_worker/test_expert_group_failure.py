"""An expert-parallel group notices a peer that dies or hangs within its timeout, whether the survivor is inside a
collective (waiting for the peer's part of a MoE exchange) or idle, and says so once (the rank worker then exits
with EXIT_GROUP_BROKEN and the launcher restarts the group: tests/launcher/test_supervisor.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from service_processes import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1.5


def _member(rank: int, port: int, events: Any, in_collective: bool) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from rank_worker.expert_parallel.group import ExpertGroup, GroupSettings

    started: list[float] = []

    def broken(reason: str) -> None:
        events.put(("broken", rank, reason, time.monotonic()))

    settings = GroupSettings(rank, 2, f"127.0.0.1:{port}", name="t", timeout_s=TIMEOUT_S, form_timeout_s=60)
    group = ExpertGroup.form(settings, torch.device("cpu"), on_broken=broken)
    events.put(("formed", rank, os.getpid(), time.monotonic()))
    if rank == 1:
        time.sleep(3600)  # the parent stops or kills it
    started.append(time.monotonic())
    if in_collective:
        try:
            group.all_gather(torch.ones(4, 8))  # waits for rank 1's part, which never comes
        except Exception as exc:  # a closed connection: the group was already reported broken
            events.put(("raised", rank, repr(exc), time.monotonic()))
    time.sleep(30)


def _start(in_collective: bool) -> tuple[Any, list[Any], dict[int, int]]:
    """Rank 0's events (a queue of its own: a queue's write lock is shared by its writers, and a writer stopped
    holding it would hold up the other's reports), the processes, and their pids."""
    context = multiprocessing.get_context("spawn")
    queues = [context.Queue() for _ in range(2)]
    port = free_port()
    procs = [context.Process(target=_member, args=(rank, port, queues[rank], in_collective)) for rank in range(2)]
    for proc in procs:
        proc.start()
    pids: dict[int, int] = {}
    for rank, queue in enumerate(queues):
        kind, got, pid, _ = queue.get(timeout=120)
        assert (kind, got) == ("formed", rank), (kind, got, pid)
        pids[rank] = pid
    return queues[0], procs, pids


def _stop_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.join(timeout=10)


@pytest.mark.parametrize("in_collective", [True, False], ids=["in-a-collective", "idle"])
def test_a_hung_peer_breaks_the_group_within_its_timeout(in_collective: bool) -> None:
    events, procs, pids = _start(in_collective)
    try:
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        kind, rank, reason, at = events.get(timeout=30)
        assert (kind, rank) == ("broken", 0), (kind, rank, reason)
        assert "rank 1 has not answered" in reason
        # heartbeats every timeout/5: noticed after the timeout and at most about two beats past it
        assert TIMEOUT_S <= at - stopped < TIMEOUT_S + 1.5, at - stopped
    finally:
        _stop_all(procs)


def test_a_killed_peer_breaks_the_group_at_once_in_a_collective() -> None:
    events, procs, pids = _start(in_collective=True)
    try:
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        kind, rank, reason, at = events.get(timeout=30)
        assert (kind, rank) == ("broken", 0), (kind, rank, reason)
        assert at - killed < TIMEOUT_S + 1.5, (reason, at - killed)
    finally:
        _stop_all(procs)
