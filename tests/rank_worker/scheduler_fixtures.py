"""Shared by the scheduler tests that drive a Scheduler directly (no model): queue a request, play a scheduled
batch's outcome as PagedEngine.step would, and read a sequence's chunk in a batch."""

from __future__ import annotations

from engine_fixtures import greedy

from rank_worker.engine.scheduler import ScheduledBatch, Scheduler
from rank_worker.engine.sequence import Sequence


def queue_request(sched: Scheduler, request_id: str, prompt: list[int]) -> Sequence:
    seq = Sequence(request_id, list(prompt), len(prompt), greedy(10_000), arrival_time=sched.clock())
    sched.add(seq)
    return seq


def advance(sched: Scheduler, batch: ScheduledBatch) -> None:
    """What PagedEngine.step does after the model ran: chunks computed, a token for each finished prompt or decode."""
    for seq, num_new in batch.entries:
        seq.num_computed_tokens += num_new
        sched.kv.register_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1)


def chunk_of(batch: ScheduledBatch, seq: Sequence) -> int:
    """The tokens the batch gives seq (0: none)."""
    return next((n for s, n in batch.entries if s is seq), 0)
