"""Who runs in the next step: continuous batching under a token budget, with chunked prefill.

Every running sequence asks for its uncomputed tokens (1 when decoding, a chunk of the rest of its
prompt when prefilling); running sequences go first, oldest first, then waiting ones are admitted in
arrival order while the budget, max_num_seqs and free blocks allow. When blocks run out, the newest
running sequence is preempted (its blocks released, cached ones kept as cache entries) and requeued
at the front, so it resumes from its cached prefix later.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    entries: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute now)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)


class Scheduler:
    def __init__(self, kv: KvCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.restored_tokens = 0  # cumulative tokens restored from the host tier, re-admissions included

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and release its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def waiting_prefill_tokens(self) -> int:
        return sum(seq.num_uncomputed_tokens for seq in self.waiting)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing further back can run either
            batch.entries.append((seq, num_new))
            budget -= num_new
            index += 1

        # Admit waiting sequences only when nobody was preempted this step (or they would thrash).
        while self.waiting and budget > 0 and not batch.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            fresh = seq.num_cached_tokens is None
            cached, restored = self.kv.attach_cached_prefix(seq, budget)
            self.restored_tokens += restored
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.kv.allocate(seq, num_new):
                self.kv.free(seq)  # give the prefix back; try again next step
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if fresh:
                seq.num_cached_tokens = cached
                seq.num_l1_cached_tokens = restored
                seq.first_scheduled_time = time.monotonic()
                self.prefix_query_tokens += seq.num_prompt_tokens
                self.prefix_hit_tokens += cached
            self.running.append(seq)
            batch.entries.append((seq, num_new))
            budget -= num_new
        return batch

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
