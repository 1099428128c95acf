"""The step's input tensors in persistent buffers: one pinned host buffer filled with numpy, one copy to
the device, and views of it as the ForwardBatch; decode graphs are recorded over the same device buffer.

Row layout of the [7, capacity] int64 buffers: input ids, positions, slot block, slot offset (one per flat
token), logits rows (one per sampled sequence), decode rows' block-table rows and context lengths.
"""

from __future__ import annotations

import numpy as np
import torch

from rank_worker.engine.block_tables import BlockTables
from rank_worker.engine.sequence import Sequence
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice

IDS, POSITIONS, SLOT_BLOCKS, SLOT_OFFSETS, LOGITS, DECODE_ROWS, DECODE_LENS = range(7)


class StepInputs:
    def __init__(self, capacity: int, block_size: int, tables: BlockTables, device: torch.device) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.tables = tables
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.zeros(7, capacity, dtype=torch.int64, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(7, capacity, dtype=torch.int64, device=device)

    def build(
        self, entries: list[tuple[Sequence, int]], in_flight: torch.Tensor | None = None
    ) -> tuple[ForwardBatch, list[Sequence]]:
        """The step's batch: decode rows (one token) first, then prefill chunks; and the sequences it samples.

        in_flight: decode rows only, each row's input token still on the device (the previous step's sampled
        tokens, one per entry in order, not yet appended to token_ids); every row is sampled."""
        if in_flight is not None and any(n != 1 for _, n in entries):
            raise ValueError("in-flight input tokens are for decode-only steps")
        decodes = [(seq, n) for seq, n in entries if n == 1]
        prefills = [(seq, n) for seq, n in entries if n > 1]
        ordered = decodes + prefills
        rows = self.tables.rows_for([seq for seq, _ in ordered])
        host, bs = self.host_np, self.block_size
        total = sum(n for _, n in ordered)
        if total > self.capacity:
            raise ValueError(f"step of {total} tokens exceeds the input buffers ({self.capacity})")
        cursor = 0
        sampled: list[Sequence] = []
        logits_rows: list[int] = []
        pieces: list[PrefillSlice] = []
        for (seq, num_new), row in zip(ordered, rows, strict=True):
            start = seq.num_computed_tokens
            end = cursor + num_new
            positions = np.arange(start, start + num_new)
            host[IDS, cursor:end] = 0 if in_flight is not None else seq.token_ids[start : start + num_new]
            host[POSITIONS, cursor:end] = positions
            first_block = start // bs
            table = np.asarray(seq.block_table[first_block : (start + num_new - 1) // bs + 1], dtype=np.int64)
            host[SLOT_BLOCKS, cursor:end] = table[positions // bs - first_block]
            host[SLOT_OFFSETS, cursor:end] = positions % bs
            if num_new > 1:
                pieces.append(PrefillSlice(cursor, num_new, start + num_new, row))
            cursor = end
            if in_flight is not None or start + num_new == seq.num_tokens:
                logits_rows.append(cursor - 1)
                sampled.append(seq)
        num_decodes = len(decodes)
        host[LOGITS, : len(logits_rows)] = logits_rows
        host[DECODE_ROWS, :num_decodes] = rows[:num_decodes]
        host[DECODE_LENS, :num_decodes] = [seq.num_computed_tokens + 1 for seq, _ in decodes]
        # every row's entries lie within the step's tokens (decodes and logits rows are tokens too)
        self.dev[:, :total].copy_(self.host[:, :total], non_blocking=True)
        if in_flight is not None:
            self._take_ids(in_flight, total)
        return self.batch_view(total, num_decodes, len(logits_rows), pieces), sampled

    def build_padded_decode(self, seqs: list[Sequence], padded: int, in_flight: torch.Tensor | None = None) -> None:
        """A decode-only step padded to `padded` rows, into the buffers a decode graph was recorded over.
        Padded rows write their K/V to the scratch block and attend to one token of it. in_flight: each row's
        input token on the device (see build)."""
        rows = self.tables.rows_for(seqs)
        host, bs = self.host_np, self.block_size
        count = len(seqs)
        positions = [seq.num_computed_tokens for seq in seqs]
        host[IDS, :count] = (
            0 if in_flight is not None else [seq.token_ids[p] for seq, p in zip(seqs, positions, strict=True)]
        )
        host[POSITIONS, :count] = positions
        host[SLOT_BLOCKS, :count] = [seq.block_table[p // bs] for seq, p in zip(seqs, positions, strict=True)]
        host[SLOT_OFFSETS, :count] = [p % bs for p in positions]
        host[DECODE_ROWS, :count] = rows
        host[DECODE_LENS, :count] = [p + 1 for p in positions]
        self._pad(count, padded)
        self.dev[:, :padded].copy_(self.host[:, :padded], non_blocking=True)
        if in_flight is not None:
            self._take_ids(in_flight, count)

    def _take_ids(self, tokens: torch.Tensor, count: int) -> None:
        """The first `count` input ids from the device (after the host buffer's copy, in stream order). A row whose
        draw failed holds -1: clamped to a real id, so the embedding never reads out of bounds; that row's result
        is discarded with its request."""
        if tokens.numel() != count:
            raise ValueError(f"{tokens.numel()} in-flight tokens for {count} rows")
        self.dev[IDS, :count].copy_(tokens.clamp(min=0))

    def fill_padding(self, padded: int) -> None:
        """Every row padding (graph capture at start-up, before any sequence exists)."""
        self._pad(0, padded)
        self.dev[:, :padded].copy_(self.host[:, :padded], non_blocking=True)

    def _pad(self, start: int, stop: int) -> None:
        host = self.host_np
        host[IDS, start:stop] = 0
        host[POSITIONS, start:stop] = 0
        host[SLOT_BLOCKS, start:stop] = self.tables.scratch_block
        host[SLOT_OFFSETS, start:stop] = 0
        host[DECODE_ROWS, start:stop] = self.tables.scratch_row
        host[DECODE_LENS, start:stop] = 1
        host[LOGITS, :stop] = np.arange(stop)

    def batch_view(
        self, num_tokens: int, num_decodes: int, num_logits: int, prefills: list[PrefillSlice] | None = None
    ) -> ForwardBatch:
        dev = self.dev
        return ForwardBatch(
            input_ids=dev[IDS, :num_tokens],
            positions=dev[POSITIONS, :num_tokens],
            slot_blocks=dev[SLOT_BLOCKS, :num_tokens],
            slot_offsets=dev[SLOT_OFFSETS, :num_tokens],
            logits_indices=dev[LOGITS, :num_logits],
            block_tables=self.tables.table,
            num_decodes=num_decodes,
            decode_rows=dev[DECODE_ROWS, :num_decodes],
            decode_lens=dev[DECODE_LENS, :num_decodes],
            prefills=prefills or [],
        )
