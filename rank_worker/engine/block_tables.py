"""The block table of every running sequence in one persistent device tensor, updated in place.

Rebuilding [rows, blocks] tables from Python lists every step costs O(total context) host work and a copy
of that size (128 agents at 100K tokens: 800K entries a step); a sequence's table only grows, one block
every block_size decode steps. So each sequence holds a row of a [max_rows, max_blocks] int32 tensor and a
step uploads only the entries added since that row was last written: usually none. A preempted sequence
comes back with other blocks: its row is rewritten whole (seen from its preemption count).

The last row is the scratch row: every entry the scratch block (one block past the pool that no sequence
owns). Padded rows of graph-replayed steps read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rank_worker.engine.sequence import Sequence, SequenceStatus


@dataclass
class _Row:
    index: int
    written: int  # leading entries of the sequence's block_table already in the row
    preemptions: int  # the sequence's count when the row was written: another means a new table


# New entries of one row past which rows_for copies the row's run as one slice (a 100K-token prompt's 6K blocks:
# 0.3 ms, against 2 ms for its (row, column, block) triples).
LONG_RUN = 64


class BlockTables:
    def __init__(self, max_rows: int, max_blocks: int, scratch_block: int, device: torch.device) -> None:
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.table = torch.full((max_rows + 1, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.scratch_row = max_rows
        self._free = list(range(max_rows - 1, -1, -1))
        self._rows: dict[str, tuple[Sequence, _Row]] = {}

    def rows_for(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's row, its new entries uploaded (one small copy for the whole step)."""
        rows: list[int] = []
        updates: list[int] = []  # flat (row, column, block) triples
        for seq in seqs:
            row = self._row_of(seq)
            table = seq.block_table
            if row.preemptions != seq.preemptions or row.written > len(table):
                row.written, row.preemptions = 0, seq.preemptions  # a new table after a preemption
            if len(table) - row.written > LONG_RUN:  # a long prompt's row: one slice copy, not 3 ints a block
                run = torch.tensor(table[row.written :], dtype=torch.int32)
                self.table[row.index, row.written : len(table)].copy_(run, non_blocking=True)
            else:
                for column in range(row.written, len(table)):
                    updates += (row.index, column, table[column])
            row.written = len(table)
            rows.append(row.index)
        if updates:
            triples = torch.tensor(updates, dtype=torch.int64).view(-1, 3).to(self.table.device, non_blocking=True)
            self.table[triples[:, 0], triples[:, 1]] = triples[:, 2].to(torch.int32)
        return rows

    def release(self, seq: Sequence) -> None:
        entry = self._rows.pop(seq.request_id, None)
        if entry is not None:
            self._free.append(entry[1].index)

    def _row_of(self, seq: Sequence) -> _Row:
        entry = self._rows.get(seq.request_id)
        if entry is not None and entry[0] is seq:
            return entry[1]
        if entry is not None:  # the id was reused by another sequence: its row is stale
            self.release(entry[0])
        if not self._free:
            self._reclaim()
        if len(seq.block_table) > self.max_blocks:
            raise ValueError(f"sequence needs {len(seq.block_table)} blocks; tables hold {self.max_blocks}")
        row = _Row(self._free.pop(), 0, seq.preemptions)
        self._rows[seq.request_id] = (seq, row)
        return row

    def _reclaim(self) -> None:
        """Rows of sequences that are no longer running (finished, aborted, or waiting after a preemption)."""
        for seq, _ in list(self._rows.values()):
            if seq.status is not SequenceStatus.RUNNING:
                self.release(seq)
        if not self._free:
            raise RuntimeError("no free block-table row: more running sequences than max_num_seqs")
