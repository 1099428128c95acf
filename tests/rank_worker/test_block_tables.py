"""BlockTables.rows_for: the device block table holds each sequence's blocks whichever way its new entries
travel (a long run as one slice copy, a few as (row, column, block) triples), across growth and preemption."""

from __future__ import annotations

import torch

from rank_worker.engine.block_tables import LONG_RUN, BlockTables
from rank_worker.engine.interface import SamplingParams
from rank_worker.engine.sequence import Sequence


def _seq(request_id: str, blocks: list[int]) -> Sequence:
    seq = Sequence(request_id, [1], 1, SamplingParams(), 0.0)
    seq.block_table = list(blocks)
    return seq


def test_long_runs_and_short_growth_land_in_each_sequences_row() -> None:
    tables = BlockTables(4, 400, scratch_block=999, device=torch.device("cpu"))
    long = _seq("long", list(range(7, 7 + 3 * LONG_RUN)))  # a long prompt's prefix: the slice path
    short = _seq("short", [3, 1])
    rows = tables.rows_for([long, short])
    assert tables.table[rows[0], : len(long.block_table)].tolist() == long.block_table
    assert tables.table[rows[1], :2].tolist() == [3, 1]
    assert tables.table[rows[1], 2:].eq(999).all()  # untouched columns keep the scratch block
    long.block_table += [500, 501]  # decode growth: the triples path
    short.block_table += list(range(600, 600 + LONG_RUN + 5))  # a long chunk's blocks after a short prefix
    rows = tables.rows_for([long, short])
    assert tables.table[rows[0], : len(long.block_table)].tolist() == long.block_table
    assert tables.table[rows[1], : len(short.block_table)].tolist() == short.block_table
    long.preemptions += 1  # preempted and rescheduled: a new, shorter table from column 0
    long.block_table = [42] * (LONG_RUN + 1)
    assert tables.table[tables.rows_for([long])[0], : LONG_RUN + 1].tolist() == long.block_table
