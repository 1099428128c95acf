"""Runs one scheduled batch through the model: lays the tokens out flat in the persistent input buffers,
points each at its KV slot, and samples the next token for every sequence whose tokens are all computed
after this step. Decode-only steps replay a CUDA graph recorded at start-up where there is one."""

from __future__ import annotations

import math

import torch

from rank_worker.engine.block_tables import BlockTables
from rank_worker.engine.decode_graphs import DecodeGraphs
from rank_worker.engine.gpu_timer import GpuTimer
from rank_worker.engine.interface import RequestsFailedError
from rank_worker.engine.sampler import SamplingError, sample_tokens
from rank_worker.engine.scheduler import ScheduledBatch
from rank_worker.engine.sequence import Sequence
from rank_worker.engine.step_inputs import StepInputs
from rank_worker.model.attention.backend import AttentionBackend
from rank_worker.model.causal_lm import CausalLM
from rank_worker.model.forward_batch import PrefillSlice

# Block-table rows beyond max_num_seqs: preempted sequences keep theirs until a row is needed.
SPARE_TABLE_ROWS = 16


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
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.backend = backend
        model.set_attention_backend(backend)
        self.tables = BlockTables(
            max_num_seqs + SPARE_TABLE_ROWS, -(-max_model_len // block_size), scratch_block, self.device
        )
        # A step carries at most max_num_batched_tokens; a padded decode step at most max_num_seqs rows.
        capacity = max(max_num_batched_tokens, max_num_seqs) + max_num_seqs
        self.inputs = StepInputs(capacity, block_size, self.tables, self.device)
        self.gpu_timer = GpuTimer(self.device)  # the forward's GPU time, for the serving loop's step timing
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

    def capture_graphs(self) -> float:
        """Record the decode graphs (start-up); returns the seconds it took (0 without graphs)."""
        return self.decode_graphs.capture_all() if self.decode_graphs is not None else 0.0

    def release(self, seq: Sequence) -> None:
        """The sequence left the engine: its block-table row goes back."""
        self.tables.release(seq)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        """Forward the batch; returns the sampled next token of each sequence that reached its end."""
        if self.decode_graphs is not None and all(n == 1 for _, n in batch.entries):
            seqs = [seq for seq, _ in batch.entries]
            logits = self.decode_graphs.run(seqs, self.gpu_timer)
            if logits is not None:
                # A one-token prefill chunk short of the prompt's end is computed but not sampled.
                rows = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens + 1 == seq.num_tokens]
                if len(rows) < len(seqs):
                    logits = logits[rows]
                return self._sample(logits, [seqs[i] for i in rows])
        forward, sampling_seqs = self.inputs.build(batch.entries)
        self.gpu_timer.start()
        logits = self.model(forward, self.kv_cache)
        self.gpu_timer.stop()
        return self._sample(logits, sampling_seqs)

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> dict[Sequence, int]:
        if not seqs:
            return {}
        try:
            tokens = sample_tokens(logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        except SamplingError as exc:  # raised before the step changed anything: those requests fail alone
            raise RequestsFailedError([seqs[row].request_id for row in exc.rows], exc.cause) from exc
        return dict(zip(seqs, tokens, strict=True))
