"""Run a function in R processes that form one expert-parallel group over gloo (real torch.distributed, real
sockets on loopback), and collect what each returns."""

from __future__ import annotations

import faulthandler
import multiprocessing
import pickle
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service_processes import free_port  # claimed: no other test process is given the rendezvous port

ROOT = Path(__file__).resolve().parents[2]


def _child(fn: Callable[..., Any], rank: int, size: int, port: int, args: tuple, out: Any) -> None:
    for path in (str(ROOT), str(ROOT / "tests" / "rank_worker")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import torch

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(180, exit=False)  # a hung group shows where each rank waits
    from rank_worker.expert_parallel.group import ExpertGroup, GroupSettings

    try:
        settings = GroupSettings(rank, size, f"127.0.0.1:{port}", name="test", timeout_s=30.0, form_timeout_s=60.0)
        group = ExpertGroup.form(settings, torch.device("cpu"), on_broken=lambda reason: None)
        try:
            result = fn(group, *args)
        finally:
            group.close()
        out.put((rank, pickle.dumps(result), None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))


def run_group(fn: Callable[..., Any], size: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """fn(group, *args) on each of `size` ranks (spawned processes: fn must be importable); results by rank."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port()
    procs = [context.Process(target=_child, args=(fn, rank, size, port, args, out)) for rank in range(size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(size):
            rank, payload, error = out.get(timeout=timeout_s)
            if error is not None:
                errors.append(f"rank {rank}:\n{error}")
            else:
                results[rank] = pickle.loads(payload)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[rank] for rank in range(size)]
