"""The step's input tensors in persistent buffers: a pinned host buffer filled with numpy (two in turn), one
copy to the device, and views of it as the ForwardBatch; decode graphs are recorded over the same device buffer.

Row layout of the [9, capacity] int64 buffers: input ids, positions, slot block, slot offset (one per flat
token), logits rows (one per sampled sequence), decode rows' block-table rows and context lengths, and for
input ids still on the device (CarriedTokens) where each goes and where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rank_worker.engine.block_tables import BlockTables
from rank_worker.engine.sequence import Sequence
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice

IDS, POSITIONS, SLOT_BLOCKS, SLOT_OFFSETS, LOGITS, DECODE_ROWS, DECODE_LENS, CARRY_TO, CARRY_FROM = range(9)


@dataclass(frozen=True)
class CarriedTokens:
    """Input tokens the host has not read yet: the draws of the step still running (`tokens`, one per sequence
    it samples, on the device), and for each sequence whose next input token is one of them (a PENDING_TOKEN
    in its token_ids) its row in `tokens`."""

    tokens: torch.Tensor
    rows: dict[Sequence, int]


class StepInputs:
    def __init__(
        self, capacity: int, block_size: int, tables: BlockTables, device: torch.device, dense_rows: int = 0
    ) -> None:
        self.capacity = capacity
        self.dense_rows = dense_rows  # ForwardBatch.dense_rows of every step
        self.block_size = block_size
        self.tables = tables
        self.device = device
        pin = device.type == "cuda"
        # Two host buffers in turn: a pipelined step fills one while the step before it may not have copied the
        # other yet. Before a buffer is filled again its step has been read, so its copy is done.
        self._hosts = [torch.zeros(9, capacity, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._hosts_np = [host.numpy() for host in self._hosts]
        self._turn = 0
        self.host, self.host_np = self._hosts[0], self._hosts_np[0]
        self.dev = torch.zeros(9, capacity, dtype=torch.int64, device=device)

    def _next_host(self) -> np.ndarray:
        self._turn ^= 1
        self.host, self.host_np = self._hosts[self._turn], self._hosts_np[self._turn]
        return self.host_np

    def build(
        self, entries: list[tuple[Sequence, int]], carried: CarriedTokens | None = None
    ) -> tuple[ForwardBatch, list[Sequence]]:
        """The step's batch: decode rows (one token) first, then prefill chunks; and the sequences it samples
        (those whose tokens are all computed after it). carried: input tokens taken on the device."""
        decodes = [(seq, n) for seq, n in entries if n == 1]
        prefills = [(seq, n) for seq, n in entries if n > 1]
        ordered = decodes + prefills
        rows = self.tables.rows_for([seq for seq, _ in ordered])
        host, bs = self._next_host(), self.block_size
        total = sum(n for _, n in ordered)
        if total > self.capacity:
            raise ValueError(f"step of {total} tokens exceeds the input buffers ({self.capacity})")
        cursor = 0
        sampled: list[Sequence] = []
        logits_rows: list[int] = []
        pieces: list[PrefillSlice] = []
        moves: list[tuple[int, int]] = []
        for (seq, num_new), row in zip(ordered, rows, strict=True):
            start = seq.num_computed_tokens
            end = cursor + num_new
            positions = np.arange(start, start + num_new)
            host[IDS, cursor:end] = seq.token_ids[start : start + num_new]
            host[POSITIONS, cursor:end] = positions
            first_block = start // bs
            table = np.asarray(seq.block_table[first_block : (start + num_new - 1) // bs + 1], dtype=np.int64)
            host[SLOT_BLOCKS, cursor:end] = table[positions // bs - first_block]
            host[SLOT_OFFSETS, cursor:end] = positions % bs
            if num_new > 1:
                pieces.append(PrefillSlice(cursor, num_new, start + num_new, row))
            elif carried is not None and seq in carried.rows:
                moves.append((cursor, carried.rows[seq]))
            cursor = end
            if start + num_new == seq.num_tokens:
                logits_rows.append(cursor - 1)
                sampled.append(seq)
        num_decodes = len(decodes)
        host[LOGITS, : len(logits_rows)] = logits_rows
        host[DECODE_ROWS, :num_decodes] = rows[:num_decodes]
        host[DECODE_LENS, :num_decodes] = [seq.num_computed_tokens + 1 for seq, _ in decodes]
        self._stage_moves(moves)
        # every row's entries lie within the step's tokens (decodes, logits rows and moves are tokens too)
        self.dev[:, :total].copy_(self.host[:, :total], non_blocking=True)
        self._take_ids(carried, len(moves))
        return self.batch_view(total, num_decodes, len(logits_rows), pieces), sampled

    def build_padded_decode(self, seqs: list[Sequence], padded: int, carried: CarriedTokens | None = None) -> None:
        """A decode-only step padded to `padded` rows, into the buffers a decode graph was recorded over.
        Padded rows write their K/V to the scratch block and attend to one token of it. carried: see build."""
        rows = self.tables.rows_for(seqs)
        host, bs = self._next_host(), self.block_size
        count = len(seqs)
        positions = [seq.num_computed_tokens for seq in seqs]
        host[IDS, :count] = [seq.token_ids[p] for seq, p in zip(seqs, positions, strict=True)]
        host[POSITIONS, :count] = positions
        host[SLOT_BLOCKS, :count] = [seq.block_table[p // bs] for seq, p in zip(seqs, positions, strict=True)]
        host[SLOT_OFFSETS, :count] = [p % bs for p in positions]
        host[DECODE_ROWS, :count] = rows
        host[DECODE_LENS, :count] = [p + 1 for p in positions]
        moves = [(i, carried.rows[seq]) for i, seq in enumerate(seqs) if seq in carried.rows] if carried else []
        self._stage_moves(moves)
        self._pad(count, padded)
        self.dev[:, :padded].copy_(self.host[:, :padded], non_blocking=True)
        self._take_ids(carried, len(moves))

    def _stage_moves(self, moves: list[tuple[int, int]]) -> None:
        """(flat token, row of the carried tokens) pairs into the host buffer, copied with the rest."""
        if moves:
            self.host_np[CARRY_TO : CARRY_FROM + 1, : len(moves)] = np.asarray(moves, dtype=np.int64).T

    def _take_ids(self, carried: CarriedTokens | None, count: int) -> None:
        """The carried input ids from the device (after the host buffer's copy, in stream order), each into its
        token's place. A row whose draw failed holds -1: clamped to a real id, so the embedding never reads out
        of bounds; that row's result is discarded with its request."""
        if carried is None or not count:
            return
        dev = self.dev
        taken = carried.tokens.index_select(0, dev[CARRY_FROM, :count]).clamp_(min=0)
        dev[IDS].index_copy_(0, dev[CARRY_TO, :count], taken)

    def fill_padding(self, padded: int) -> None:
        """Every row padding (graph capture at start-up, before any sequence exists)."""
        self._next_host()
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
            dense_rows=self.dense_rows,
        )
