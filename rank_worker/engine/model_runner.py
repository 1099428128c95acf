"""Runs one scheduled batch through the model: lays the tokens out flat, points each at its KV slot,
and samples the next token for every sequence whose tokens are all computed after this step."""

from __future__ import annotations

import torch

from rank_worker.engine.decode_graphs import DecodeGraphs
from rank_worker.engine.interface import RequestsFailedError
from rank_worker.engine.sampler import SamplingError, sample_tokens
from rank_worker.engine.scheduler import ScheduledBatch
from rank_worker.engine.sequence import Sequence
from rank_worker.model.forward_batch import DecodeGroup, ForwardBatch, PrefillSlice
from rank_worker.model.llama import LlamaForCausalLM


def kv_pool_shape(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> tuple[int, ...]:
    cfg = model.cfg
    return (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)


def kv_block_bytes(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.cfg
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        decode_graphs: DecodeGraphs | None = None,
        paged_kernel: bool = False,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.decode_graphs = decode_graphs  # decode-only steps padded to a bucket (CUDA graphs on a GPU)
        self.paged_kernel = paged_kernel  # decode attention by the Triton kernel (CUDA)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        """Forward the batch; returns the sampled next token of each sequence that reached its end."""
        if self.decode_graphs is not None and all(n == 1 for _, n in batch.entries):
            seqs = [seq for seq, _ in batch.entries]
            logits = self.decode_graphs.run(seqs)
            if logits is not None:
                # A one-token prefill chunk short of the prompt's end is computed but not sampled.
                rows = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens + 1 == seq.num_tokens]
                if len(rows) < len(seqs):
                    logits = logits[rows]
                return self._sample(logits, [seqs[i] for i in rows])
        forward, sampling_seqs = self.build_forward_batch(batch.entries)
        return self._sample(self.model(forward, self.kv_cache), sampling_seqs)

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> dict[Sequence, int]:
        if not seqs:
            return {}
        try:
            tokens = sample_tokens(logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        except SamplingError as exc:  # raised before the step changed anything: those requests fail alone
            raise RequestsFailedError([seqs[row].request_id for row in exc.rows], exc.cause) from exc
        return dict(zip(seqs, tokens, strict=True))

    def build_forward_batch(self, entries: list[tuple[Sequence, int]]) -> tuple[ForwardBatch, list[Sequence]]:
        decodes = [(seq, n) for seq, n in entries if n == 1]
        prefills = [(seq, n) for seq, n in entries if n > 1]
        bs = self.block_size
        ids: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        slot_blocks: list[torch.Tensor] = []
        logits_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        cursor = 0
        prefill_meta: list[tuple[int, int, int, torch.Tensor]] = []
        for seq, num_new in decodes + prefills:
            start = seq.num_computed_tokens
            pos = torch.arange(start, start + num_new)
            table = torch.tensor(seq.block_table, dtype=torch.long)
            ids.append(torch.tensor(seq.token_ids[start : start + num_new], dtype=torch.long))
            positions.append(pos)
            slot_blocks.append(table[pos // bs])
            if num_new > 1:
                prefill_meta.append((cursor, num_new, start + num_new, table))
            cursor += num_new
            if start + num_new == seq.num_tokens:
                logits_rows.append(cursor - 1)
                sampling_seqs.append(seq)

        dev = self.device
        pos_all = torch.cat(positions)
        decode_group = None
        if decodes:
            max_blocks = max(len(seq.block_table) for seq, _ in decodes)
            tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq, _ in decodes]
            lens = [seq.num_computed_tokens + 1 for seq, _ in decodes]
            decode_group = DecodeGroup(
                num_seqs=len(decodes),
                block_tables=torch.tensor(tables, dtype=torch.long).to(dev, non_blocking=True),
                context_lens=torch.tensor(lens, dtype=torch.long).to(dev, non_blocking=True),
                max_context_len=max(lens),
                paged_kernel=self.paged_kernel,
            )
        forward = ForwardBatch(
            input_ids=torch.cat(ids).to(dev, non_blocking=True),
            positions=pos_all.to(dev, non_blocking=True),
            slot_blocks=torch.cat(slot_blocks).to(dev, non_blocking=True),
            slot_offsets=(pos_all % bs).to(dev, non_blocking=True),
            decode=decode_group,
            prefills=[
                PrefillSlice(start, n, ctx, table.to(dev, non_blocking=True)) for start, n, ctx, table in prefill_meta
            ],
            logits_indices=torch.tensor(logits_rows, dtype=torch.long).to(dev, non_blocking=True),
        )
        return forward, sampling_seqs
