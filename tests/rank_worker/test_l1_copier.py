"""The L1 copy path without a kvstore: the arena file mapped shared as KV blocks, and block copies between
a pool and arena slots (bytes equal after offload + restore, written through to the file itself)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from rank_worker.l1.arena import ArenaLayout, ArenaMapping, ArenaMappingError
from rank_worker.l1.block_copier import BlockCopier, contiguous_runs

BLOCK_SHAPE = (2, 2, 4, 2, 8)  # layers, k/v, block_size, kv_heads, head_dim
SLOT_BYTES = int(np.prod(BLOCK_SHAPE)) * 4  # float32


def arena_file(directory: Path, num_slots: int, extra_bytes: int = 100) -> ArenaLayout:
    """An arena file as the kvstore makes one: zeros, a little larger than its slots."""
    path = directory / "kvserve-l1-test"
    size = num_slots * SLOT_BYTES + extra_bytes
    with path.open("wb") as file:
        file.truncate(size)
    return ArenaLayout("arena-1", str(path), size, SLOT_BYTES, num_slots)


def test_contiguous_runs_merge_pairs_consecutive_on_both_sides() -> None:
    assert contiguous_runs([3, 4, 5, 9], [10, 11, 12, 0]) == [(3, 10, 3), (9, 0, 1)]
    assert contiguous_runs([5, 3, 4], [12, 10, 11]) == [(3, 10, 3)]  # order of the pairs does not matter
    assert contiguous_runs([1, 2], [7, 5]) == [(1, 7, 1), (2, 5, 1)]  # consecutive sources, scattered slots
    assert contiguous_runs([], []) == []
    with pytest.raises(ValueError):
        contiguous_runs([1], [])


def test_offload_then_restore_gives_back_the_same_bytes(tmp_path: Path) -> None:
    layout = arena_file(tmp_path, num_slots=10)
    arena = ArenaMapping(layout, BLOCK_SHAPE, torch.float32)
    pool = torch.randn(8, *BLOCK_SHAPE)
    original = pool.clone()
    copier = BlockCopier(pool, arena.slots)
    blocks, slots = [5, 1, 2, 3, 7], [0, 4, 5, 6, 9]
    job = copier.offload(blocks, slots)
    assert job.done  # the CPU copies before returning

    # The bytes are in the file itself, where another process mapping it (the next rank) reads them.
    on_disk = np.fromfile(layout.path, dtype=np.float32)[: 10 * SLOT_BYTES // 4].reshape(10, *BLOCK_SHAPE)
    for block, slot in zip(blocks, slots, strict=True):
        assert np.array_equal(on_disk[slot], original[block].numpy())
    assert not on_disk[[1, 2, 3, 7, 8]].any()  # untouched slots stay untouched

    pool.zero_()
    targets = [0, 6, 4, 3, 2]
    assert copier.restore(slots, targets).done
    for target, block in zip(targets, blocks, strict=True):
        assert torch.equal(pool[target], original[block])
    assert not pool[[1, 5, 7]].any()
    arena.close()


def test_two_mappings_of_one_arena_share_their_bytes(tmp_path: Path) -> None:
    layout = arena_file(tmp_path, num_slots=4)
    writer = ArenaMapping(layout, BLOCK_SHAPE, torch.float32)
    reader = ArenaMapping(layout, BLOCK_SHAPE, torch.float32)
    writer.slots[2].fill_(1.25)
    assert torch.all(reader.slots[2] == 1.25)
    writer.close()
    reader.close()
    assert reader.slots.numel() == 0


def test_mapping_refuses_a_layout_that_does_not_fit(tmp_path: Path) -> None:
    layout = arena_file(tmp_path, num_slots=4)
    with pytest.raises(ArenaMappingError, match="one KV block is"):
        ArenaMapping(layout, (2, 2, 4, 2, 4), torch.float32)  # half the slot size
    too_many = ArenaLayout(layout.arena_id, layout.path, layout.arena_bytes, SLOT_BYTES, 5)
    with pytest.raises(ArenaMappingError, match="cannot hold"):
        ArenaMapping(too_many, BLOCK_SHAPE, torch.float32)
    missing = ArenaLayout("gone", str(tmp_path / "missing"), layout.arena_bytes, SLOT_BYTES, 4)
    with pytest.raises(ArenaMappingError, match="cannot map"):
        ArenaMapping(missing, BLOCK_SHAPE, torch.float32)
    assert not Path(missing.path).exists()  # never created: a rank must not write into a file nobody reads


def test_copier_refuses_slots_of_another_shape_or_dtype() -> None:
    with pytest.raises(ValueError, match="do not match"):
        BlockCopier(torch.zeros(4, *BLOCK_SHAPE), torch.zeros(4, *BLOCK_SHAPE, dtype=torch.float16))
    with pytest.raises(ValueError, match="do not match"):
        BlockCopier(torch.zeros(4, *BLOCK_SHAPE), torch.zeros(4, 2, 2, 4, 2, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["shm", "disk"])
def test_cuda_copies_are_asynchronous_and_exact(tmp_path: Path, where: str) -> None:
    shape = (4, 2, 16, 8, 128)  # 256 KB blocks in bfloat16
    slot_bytes = int(np.prod(shape)) * 2
    directory = Path(tempfile.mkdtemp(dir="/dev/shm")) if where == "shm" else tmp_path
    path = directory / "arena"
    with path.open("wb") as file:
        file.truncate(64 * slot_bytes)
    arena = ArenaMapping(ArenaLayout("a", str(path), 64 * slot_bytes, slot_bytes, 64), shape, torch.bfloat16, True)
    # /dev/shm registers as pinned memory; a disk file may not, and then copies are slower but still exact.
    assert arena.pinned or where == "disk"
    pool = torch.randn(32, *shape, device="cuda", dtype=torch.bfloat16)
    original = pool.clone()
    copier = BlockCopier(pool, arena.slots)
    blocks, slots = list(range(4, 20)), list(range(40, 56))
    offload = copier.offload(blocks, slots)
    assert offload.event is not None
    offload.wait()
    assert offload.done
    assert torch.equal(arena.slots[40:56], original[4:20].cpu())
    pool.zero_()
    restore = copier.restore(slots, list(range(16)))
    restore.wait()
    assert torch.equal(pool[:16], original[4:20])
    # a save runs on the compute stream: a kernel queued after it (the step that reuses the blocks) writes them
    # only once they are read, with no wait in between on the host
    pool.copy_(original)
    save = copier.save(list(range(20, 28)), list(range(0, 8)))
    pool.zero_()
    save.wait()
    assert torch.equal(arena.slots[0:8], original[20:28].cpu()) and not pool.any()
    copier.synchronize()
    arena.close()
    assert not arena.pinned
    if where == "shm":
        shutil.rmtree(directory)
