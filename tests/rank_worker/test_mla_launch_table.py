"""The MLA decode kernel's launch table (mla_decode_kernel.LAUNCH_FILE, written by bench/probes/mla_decode_probe.py
--write-launch): which measured batch size a batch takes, and that the committed table holds launches the kernel
accepts. Pure Python: runs without CUDA."""

from __future__ import annotations

import json

from rank_worker.model.attention import mla_decode_kernel
from rank_worker.model.attention.mla_decode_kernel import launch_for

ENTRIES = ((1, {"slices": 64}), (16, {"slices": 16}), (128, {"slices": 2}))


def test_a_batch_takes_the_largest_measured_batch_not_above_it() -> None:
    assert launch_for(ENTRIES, 1) == {"slices": 64}
    assert launch_for(ENTRIES, 15) == {"slices": 64}
    assert launch_for(ENTRIES, 16) == {"slices": 16}
    assert launch_for(ENTRIES, 127) == {"slices": 16}
    assert launch_for(ENTRIES, 512) == {"slices": 2}


def test_below_every_measured_batch_the_smallest_one_serves_and_none_measured_means_defaults() -> None:
    assert launch_for(((8, {"slices": 32}), (64, {"slices": 4})), 2) == {"slices": 32}
    assert launch_for((), 16) == {}


def test_the_entry_handed_out_is_a_copy() -> None:
    launch_for(ENTRIES, 16).pop("slices")
    assert ENTRIES[1][1] == {"slices": 16}


def test_the_committed_table_holds_launches_the_kernel_takes() -> None:
    if not mla_decode_kernel.LAUNCH_FILE.exists():
        return  # no GPU measured yet: the kernel's defaults serve
    table = json.loads(mla_decode_kernel.LAUNCH_FILE.read_text())
    keys = {"TILE", "num_warps", "num_stages", "slices", "min_slice"}
    assert table["gpus"], "a table without a GPU"
    for shapes in table["gpus"].values():
        for shape, by_batch in shapes.items():
            assert len(shape.split("/")) == 3, shape  # heads/rank/rope
            for batch, launch in by_batch.items():
                assert int(batch) >= 1 and set(launch) <= keys, (batch, launch)
                assert launch["slices"] & (launch["slices"] - 1) == 0, launch  # the merge's arange
                assert launch.get("min_slice", 0) >= 0 and launch["TILE"] in (16, 32, 64), launch


def test_default_slicing_fills_the_gpu_at_small_batches_and_thins_out_at_large_ones() -> None:
    from rank_worker.model.attention.mla_decode_kernel import MAX_SLICES, TARGET_PROGRAMS, default_slices

    assert default_slices(1, 1) == MAX_SLICES  # one V2-Lite row: one head block, as many slices as allowed
    assert default_slices(16, 1) == TARGET_PROGRAMS // 16
    assert default_slices(1, 8) == TARGET_PROGRAMS // 8  # V3's 128 heads: eight head blocks a row
    assert default_slices(3, 1) == 512 and default_slices(5, 1) == 256  # a power of two, rounded down
    assert default_slices(4096, 1) == 1
