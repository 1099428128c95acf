"""Decode steps replayed from CUDA graphs recorded at start-up, one per batch-size bucket.

A decode step of an 8B model launches hundreds of small kernels; issued one by one from Python the GPU
waits on the CPU (on the H200 an eager step of 8 sequences took about four times a replayed one). A CUDA
graph records the launches once and replays them in one call. Graphs need fixed shapes and addresses: the
step's inputs live in the persistent StepInputs buffers and the block tables in the persistent BlockTables
tensor, and the attention kernels' grids depend on the batch size alone (not on context length), so one
graph per batch bucket serves every context; a step is padded up to its bucket.

Padded rows are harmless: they write their K/V into the scratch block (one block past the pool that no
sequence ever owns), attend to one token of it, and their logits are never read.

Serving engines without graphs (the CPU, or an attention backend that is not graph-safe) run decode steps
unpadded; with capture=False this class runs the padded forward eagerly, which lets CPU tests check the
padding against the unpadded step.
"""

from __future__ import annotations

import logging
import time

import torch

from rank_worker.engine.gpu_timer import GpuTimer
from rank_worker.engine.sequence import Sequence
from rank_worker.engine.step_inputs import CarriedTokens, StepInputs
from rank_worker.model.causal_lm import CausalLM

log = logging.getLogger(__name__)


def size_buckets(limit: int, smallest: int = 1) -> list[int]:
    """1, 2, 4, then powers of two with a midpoint (8, 12, 16, 24, 32, 48, ...) up to limit, which is last."""
    sizes: list[int] = []
    size = smallest
    while size < limit:
        sizes.append(size)
        half_step = size + size // 2
        if size >= 8 and half_step < limit:
            sizes.append(half_step)
        size *= 2
    sizes.append(limit)
    return sorted(set(sizes))


def bucket_for(value: int, buckets: list[int]) -> int | None:
    for size in buckets:
        if size >= value:
            return size
    return None


class DecodeGraphs:
    """Decode-only steps padded to a batch bucket and replayed from the graph recorded for it."""

    def __init__(
        self, model: CausalLM, kv_cache: torch.Tensor, inputs: StepInputs, max_batch: int, capture: bool = True
    ) -> None:
        self.model = model
        self.capture = capture
        self.kv_cache = kv_cache
        self.inputs = inputs
        self.buckets = size_buckets(max_batch)
        self.logits = torch.zeros(max_batch, model.cfg.vocab_size, dtype=torch.float32, device=kv_cache.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.steps = 0  # decode steps replayed
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def capture_all(self) -> float:
        """Record every bucket's graph (largest first, so the shared pool is sized once); returns seconds."""
        started = time.perf_counter()
        for batch in sorted(self.buckets, reverse=True):
            self._record(batch)
        seconds = time.perf_counter() - started
        log.info("decode graphs recorded for batch sizes %s in %.1f s", self.buckets, seconds)
        return seconds

    @torch.inference_mode()
    def run(
        self,
        seqs: list[Sequence],
        timer: GpuTimer | None = None,
        carried: CarriedTokens | None = None,
        rows: int | None = None,
    ) -> torch.Tensor | None:
        """Logits [len(seqs), vocab] for one decode token of each sequence (its next uncomputed token, taken on
        the device where carried: StepInputs.build), or None when the step fits no recorded graph (the caller
        runs it eagerly). rows: the bucket is the one for this many rows (an expert-parallel group's largest
        decode step: every rank replays the same graph), not for len(seqs)."""
        batch = bucket_for(max(len(seqs), rows or 0), self.buckets)
        if batch is None or (self.capture and batch not in self.graphs):
            return None
        self.inputs.build_padded_decode(seqs, batch, carried)
        self.steps += 1
        if timer is not None:
            timer.start()
        if self.capture:
            self.graphs[batch].replay()
        else:
            self.forward(batch)
        if timer is not None:
            timer.stop()
        return self.logits[: len(seqs)]

    def forward(self, batch: int) -> None:
        """The padded forward of one bucket over the persistent buffers (eagerly, or inside a capture)."""
        view = self.inputs.batch_view(batch, batch, batch)
        self.logits[:batch].copy_(self.model(view, self.kv_cache))

    @torch.inference_mode()
    def _record(self, batch: int) -> None:
        self.inputs.fill_padding(batch)
        device = self.kv_cache.device
        # Warm up on a side stream first: lazy kernel compilation and workspace set-up must not land in the
        # graph. Padded rows only touch the scratch block.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(batch)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the L1 attach thread may register host memory with CUDA while this one records.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.forward(batch)
        self.graphs[batch] = graph
