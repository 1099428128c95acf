"""Runs one scheduled batch through the model: lays the tokens out flat in the persistent input buffers,
points each at its KV slot, and samples the next token for every sequence whose tokens are all computed
after this step. Decode-only steps replay a CUDA graph recorded at start-up where there is one."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TypeVar

import torch

from rank_worker.engine.block_tables import BlockTables
from rank_worker.engine.decode_graphs import DecodeGraphs
from rank_worker.engine.gpu_timer import GpuTimer
from rank_worker.engine.interface import RequestsFailedError
from rank_worker.engine.sampler import PendingTokens, launch_sampling
from rank_worker.engine.scheduler import ScheduledBatch
from rank_worker.engine.sequence import Sequence
from rank_worker.engine.step_inputs import CarriedTokens, StepInputs
from rank_worker.engine.step_trace import phase
from rank_worker.expert_parallel.lockstep import GroupStep, Lockstep
from rank_worker.model.attention.backend import AttentionBackend
from rank_worker.model.causal_lm import CausalLM
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice

T = TypeVar("T")

log = logging.getLogger(__name__)

# Block-table rows beyond max_num_seqs: preempted sequences keep theirs until a row is needed.
SPARE_TABLE_ROWS = 16
# Pinned buffers the sampled tokens are read through, in rotation: a step is read while the next one runs.
TOKEN_BUFFERS = 3


class LaunchedStep:
    """A forward launched with its tokens drawn on the device (or nothing to sample: a mid-prompt chunk)."""

    def __init__(self, seqs: list[Sequence], pending: PendingTokens | None, gpu_span: object) -> None:
        self.seqs = seqs  # the sampled sequences, in the order of pending.tokens
        self.pending = pending
        self.gpu_span = gpu_span  # GpuTimer.stop's span (None on the CPU)

    @property
    def tokens(self) -> torch.Tensor | None:
        """The drawn tokens on the device (one per sampled sequence), for the next step's input ids."""
        return self.pending.tokens if self.pending is not None else None

    def read(self) -> tuple[dict[Sequence, int], dict[Sequence, BaseException]]:
        """Each sampled sequence's token, and the sequences whose draw failed (not in the first) with why."""
        if self.pending is None:
            return {}, {}
        tokens, failures = self.pending.read()
        drawn = {
            seq: token for row, (seq, token) in enumerate(zip(self.seqs, tokens, strict=True)) if row not in failures
        }
        return drawn, {self.seqs[row]: cause for row, cause in sorted(failures.items())}

    def read_all(self) -> dict[Sequence, int]:
        """Each sampled sequence's token; a failed draw fails the step before anything changed: the seeded
        generators are put back and RequestsFailedError names the requests (the others retry unchanged)."""
        tokens, failed = self.read()
        if failed:
            assert self.pending is not None
            self.pending.restore_generators()
            raise RequestsFailedError([seq.request_id for seq in failed], next(iter(failed.values())))
        return tokens


def kv_pool_shape(model: CausalLM, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Block-major: [num_blocks, *the model's block] (Llama [layers, 2, bs, kv_heads, head_dim]; MLA
    [layers, 1, bs, 1, latent_dim]), so one block is one contiguous chunk for the L1 copies."""
    return (num_blocks, *model.kv_block_shape(block_size))


def kv_block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    return math.prod(model.kv_block_shape(block_size)) * dtype.itemsize


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        backend: AttentionBackend,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        scratch_block: int,
        cuda_graphs: bool,
        max_step_tokens: int = 0,
        lockstep: Lockstep | None = None,
    ) -> None:
        """max_step_tokens: the most tokens a step carries (a solo prefill's, past max_num_batched_tokens; 0: that);
        the MLP of a step longer than max_num_batched_tokens runs that many rows at a time (ForwardBatch.dense_rows)."""
        self.model = model
        self.lockstep = lockstep  # an expert-parallel group's: every launch agreed with the group's ranks
        self.launches = 0  # forwards launched, real or (in a group) empty
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.backend = backend
        model.set_attention_backend(backend)
        self.tables = BlockTables(
            max_num_seqs + SPARE_TABLE_ROWS, -(-max_model_len // block_size), scratch_block, self.device
        )
        # A step carries at most max_step_tokens; a padded decode step at most max_num_seqs rows.
        capacity = max(max_num_batched_tokens, max_step_tokens, max_num_seqs) + max_num_seqs
        self.inputs = StepInputs(capacity, block_size, self.tables, self.device, dense_rows=max_num_batched_tokens)
        self.gpu_timer = GpuTimer(self.device)  # the forward's GPU time, for the serving loop's step timing
        pin = self.device.type == "cuda"
        self._token_buffers = [
            torch.empty(max_num_seqs + SPARE_TABLE_ROWS, dtype=torch.int64, pin_memory=pin)
            for _ in range(TOKEN_BUFFERS)
        ]
        self._next_buffer = 0
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda" and backend.graph_safe:
            self.decode_graphs = DecodeGraphs(model, kv_cache, self.inputs, max_num_seqs)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the step's kernels now (start-up), not in a request's step: one forward of a two-token chunk
        over a one-block prefix and one decode row, all on the scratch row and block."""
        if self.device.type != "cuda":
            return
        inputs = self.inputs
        inputs.fill_padding(3)
        prefill = PrefillSlice(
            token_start=1, num_new=2, context_len=self.block_size + 2, table_row=self.tables.scratch_row
        )
        self.model(inputs.batch_view(3, 1, 1, [prefill]), self.kv_cache)
        torch.cuda.synchronize(self.device)
        seconds = self.backend.warm_up(self.kv_cache)  # kernels that compile per variant (FA4's)
        if seconds:
            log.info("attention backend %s compiled its kernels in %.1f s", self.backend.name, seconds)

    def capture_graphs(self) -> float:
        """Record the decode graphs (start-up); returns the seconds it took (0 without graphs)."""
        return self.decode_graphs.capture_all() if self.decode_graphs is not None else 0.0

    def release(self, seq: Sequence) -> None:
        """The sequence left the engine: its block-table row goes back."""
        self.tables.release(seq)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, carried: CarriedTokens | None = None) -> LaunchedStep:
        """Forward the batch and draw the next token of each sequence that reaches its end, without reading them.
        carried: input tokens still on the device (the step in flight's draws), for a step launched before its
        predecessor is read."""
        self.launches += 1
        decode_only = all(n == 1 for _, n in batch.entries)
        if self.lockstep is not None:
            return self._launch_in_group(batch, carried, decode_only)
        if self.decode_graphs is not None and decode_only:
            replayed = self._replayed(batch, carried)
            if replayed is not None:
                return replayed
        forward, sampling_seqs = self.inputs.build(batch.entries, carried)
        self.gpu_timer.start()
        logits = self.model(forward, self.kv_cache)
        return self._sampled(logits, sampling_seqs, self.gpu_timer.stop())

    def _launch_in_group(self, batch: ScheduledBatch, carried: CarriedTokens | None, decode_only: bool) -> LaunchedStep:
        """launch() in an expert-parallel group: the group agrees first, then every rank runs the same
        exchanges: the agreed decode graph bucket when every rank decodes, else an eager forward under the
        agreed exchange plan."""
        assert self.lockstep is not None
        step = self.lockstep.agree(batch.num_tokens, decode_only and self.decode_graphs is not None, busy=True)
        if self.decode_graphs is not None and step.all_decode:
            replayed = self._in_group(lambda: self._replayed(batch, carried, rows=step.tokens))
            if replayed is not None:
                return replayed
        forward, sampling_seqs = self.inputs.build(batch.entries, carried)
        self.gpu_timer.start()
        logits = self._eager_in_group(forward, step)
        return self._sampled(logits, sampling_seqs, self.gpu_timer.stop())

    def _replayed(
        self, batch: ScheduledBatch, carried: CarriedTokens | None, rows: int | None = None
    ) -> LaunchedStep | None:
        """A decode-only step replayed from its bucket's graph (rows: DecodeGraphs.run's), or None where no graph
        fits (the caller runs it eagerly)."""
        assert self.decode_graphs is not None
        seqs = [seq for seq, _ in batch.entries]
        logits = self.decode_graphs.run(seqs, self.gpu_timer, carried, rows=rows)
        if logits is None:
            return None
        span = self.gpu_timer.last_span()
        # A one-token prefill chunk short of the prompt's end is computed but not sampled.
        sampled = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens + 1 == seq.num_tokens]
        if len(sampled) < len(seqs):
            logits = logits[sampled]
        return self._sampled(logits, [seqs[i] for i in sampled], span)

    @torch.inference_mode()
    def launch_empty(self, busy: bool) -> None:
        """In an expert-parallel group, a launch with nothing of this rank's own: agreed with the group, and where
        another rank has tokens, a forward of padding rows only (the decode graph of the agreed bucket, or one
        eager padding row) so that every exchange of the group has this rank in it. busy: this rank still has
        work in flight (a step to read, L1 copies), so the group steps again."""
        assert self.lockstep is not None
        self.launches += 1
        step = self.lockstep.agree(0, True, busy)
        if step.tokens == 0:
            return  # no rank has tokens: no forward anywhere
        self.lockstep.empty_steps += 1
        graphs = self.decode_graphs
        replayed = graphs is not None and step.all_decode
        if replayed and self._in_group(lambda: graphs.run([], rows=step.tokens)) is not None:
            self._settle()
            return
        self.inputs.fill_padding(1)
        self._eager_in_group(self.inputs.batch_view(1, 1, 1), step)
        self._settle()

    def _eager_in_group(self, forward: ForwardBatch, step: GroupStep) -> torch.Tensor:
        exchange = self.lockstep.exchange if self.lockstep is not None else None
        assert exchange is not None
        exchange.plan = step.plan(self.inputs.dense_rows)
        try:
            return self._in_group(lambda: self.model(forward, self.kv_cache))
        finally:
            exchange.plan = None

    def _in_group(self, forward: Callable[[], T]) -> T:
        """A forward with the group's exchanges in it: one that fails part-way has left the group's collectives
        out of step, which no retry can mend: the group is broken (its ranks restart together)."""
        try:
            return forward()
        except Exception as exc:
            assert self.lockstep is not None
            self.lockstep.group.broken(f"a forward failed inside the group's exchanges: {exc!r}")
            raise

    def _settle(self) -> None:
        """After an empty step on CUDA: its input buffers are refilled two launches on, perhaps before the device
        has copied them (nothing reads an empty step's tokens, which is what orders a real step's reuse)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _sampled(self, logits: torch.Tensor, seqs: list[Sequence], span: object) -> LaunchedStep:
        if not seqs:
            return LaunchedStep([], None, span)
        buffer = self._token_buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % len(self._token_buffers)
        with phase("sample"):
            pending = launch_sampling(logits, [s.sampling for s in seqs], [s.generator for s in seqs], buffer)
        return LaunchedStep(seqs, pending, span)
