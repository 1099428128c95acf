"""Copies of whole KV blocks between the pool and arena slots, grouped into as few copies as the layout allows.

Pairs (pool block, slot) whose block ids and slot numbers both run consecutively become one copy of the
whole run. On CUDA, offloads run on a side stream (after the compute stream's pending writes), restores and
saves (an evicted block's copy) on the compute stream, all asynchronous: a CopyJob's event says when the bytes
have landed, so the engine polls instead of waiting. On the CPU a copy is done when the call returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

CopyRun = tuple[int, int, int]  # (first source index, first destination index, length)


def contiguous_runs(sources: list[int], destinations: list[int]) -> list[CopyRun]:
    """The pairs (sources[i], destinations[i]) as runs where both sides are consecutive, in source order."""
    if len(sources) != len(destinations):
        raise ValueError(f"{len(sources)} sources but {len(destinations)} destinations")
    runs: list[CopyRun] = []
    for src, dst in sorted(zip(sources, destinations, strict=True)):
        if runs:
            first_src, first_dst, length = runs[-1]
            if src == first_src + length and dst == first_dst + length:
                runs[-1] = (first_src, first_dst, length + 1)
                continue
        runs.append((src, dst, 1))
    return runs


@dataclass(eq=False)
class CopyJob:
    """One batch of block copies; `done` once the bytes are in place (always, on the CPU)."""

    block_ids: list[int]
    slots: list[int]
    event: torch.cuda.Event | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # what the copied blocks hold (offloads)
    to_front: bool = False  # offloads: the blocks go back to the front of L0's free queue (L1Tier's horizon)
    issued_at: float = field(default_factory=time.perf_counter)  # before its copies were queued (the metrics)

    @property
    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class BlockCopier:
    """Moves blocks between `kv_cache` [num_blocks, *block_shape] and `slots` [num_slots, *block_shape]."""

    def __init__(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        if kv_cache.shape[1:] != slots.shape[1:] or kv_cache.dtype != slots.dtype:
            raise ValueError(
                f"pool blocks {tuple(kv_cache.shape[1:])} {kv_cache.dtype} do not match "
                f"arena slots {tuple(slots.shape[1:])} {slots.dtype}"
            )
        self.kv_cache = kv_cache
        self.slots = slots
        self.on_cuda = kv_cache.device.type == "cuda"
        self._side_stream = torch.cuda.Stream(kv_cache.device) if self.on_cuda else None

    def offload(self, block_ids: list[int], slots: list[int]) -> CopyJob:
        """Pool blocks -> arena slots. On CUDA it runs behind every kernel already queued on the compute stream."""
        job = CopyJob(list(block_ids), list(slots))
        if self._side_stream is None:
            self._copy_runs(contiguous_runs(block_ids, slots), self.kv_cache, self.slots)
            return job
        self._side_stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self._side_stream):
            self._copy_runs(contiguous_runs(block_ids, slots), self.kv_cache, self.slots)
            job.event = torch.cuda.Event()
            job.event.record(self._side_stream)
        return job

    def save(self, block_ids: list[int], slots: list[int]) -> CopyJob:
        """Pool blocks -> arena slots on the compute stream (exclusive tiers: blocks the pool just evicted): behind
        every kernel already queued and ahead of any queued later, so the step that reuses the blocks writes them
        only once their bytes are read."""
        job = CopyJob(list(block_ids), list(slots))
        self._copy_runs(contiguous_runs(block_ids, slots), self.kv_cache, self.slots)
        return self._recorded(job)

    def restore(self, slots: list[int], block_ids: list[int]) -> CopyJob:
        """Arena slots -> pool blocks, on the compute stream, so kernels queued after it see the data."""
        job = CopyJob(list(block_ids), list(slots))
        self._copy_runs(contiguous_runs(slots, block_ids), self.slots, self.kv_cache)
        return self._recorded(job)

    def _recorded(self, job: CopyJob) -> CopyJob:
        """On CUDA: the job's event, recorded on the compute stream behind its copies."""
        if self.on_cuda:
            job.event = torch.cuda.Event()
            job.event.record(torch.cuda.current_stream(self.kv_cache.device))
        return job

    def _copy_runs(self, runs: list[CopyRun], source: torch.Tensor, destination: torch.Tensor) -> None:
        for src, dst, length in runs:
            destination[dst : dst + length].copy_(source[src : src + length], non_blocking=self.on_cuda)

    def synchronize(self) -> None:
        """Wait for every copy this copier queued (before the arena is unmapped)."""
        if self._side_stream is not None:
            self._side_stream.synchronize()
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
