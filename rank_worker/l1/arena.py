"""One kvstore arena mapped into this process: the shared file viewed as [num_slots, *block_shape] KV blocks.

Slot i is the byte range [i * slot_bytes, (i + 1) * slot_bytes) of the file, one physical block laid out
exactly as the pool lays it out. On CUDA the mapping is registered as pinned memory so copies run at full
PCIe speed (measured 54 GB/s on an H200 host; pageable memory is about 8x slower) and asynchronously. A
mapping CUDA will not register (an arena on a disk filesystem rather than /dev/shm) still works, unpinned:
its copies are slower and synchronous, never wrong.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArenaLayout:
    """What the kvstore's Attach answers: which arena, where it lives and how it is cut into slots (the
    kvstore keeps the slots' part as kvstore.arena_layout.SlotLayout)."""

    arena_id: str
    path: str
    arena_bytes: int
    slot_bytes: int
    num_slots: int


class ArenaMappingError(RuntimeError):
    """The arena cannot be mapped as KV blocks (missing file, wrong layout, registration failed)."""


class ArenaMapping:
    """The arena file mapped shared; `slots` is its block view. close() unregisters and unmaps."""

    def __init__(
        self, layout: ArenaLayout, block_shape: tuple[int, ...], dtype: torch.dtype, pin_for_cuda: bool = False
    ) -> None:
        block_bytes = math.prod(block_shape) * dtype.itemsize
        if layout.slot_bytes != block_bytes:
            raise ArenaMappingError(f"arena slots hold {layout.slot_bytes} bytes but one KV block is {block_bytes}")
        used = layout.num_slots * layout.slot_bytes
        if layout.num_slots < 1 or used > layout.arena_bytes:
            raise ArenaMappingError(
                f"arena of {layout.arena_bytes} bytes cannot hold {layout.num_slots} slots of {layout.slot_bytes}"
            )
        self.layout = layout
        self._mmap = _map_existing(layout.path, layout.arena_bytes)
        self._raw = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.slots = self._raw[:used].view(dtype).view(layout.num_slots, *block_shape)
        self._registered_ptr: int | None = None
        if pin_for_cuda:
            self._pin(used)

    def _pin(self, nbytes: int) -> None:
        ptr = self._raw.data_ptr()
        error = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if error != 0:
            _drain_pending_cuda_error()
            log.warning(
                "cudaHostRegister of the L1 arena %s failed (CUDA error %d): copies will use pageable memory, "
                "several times slower; put the arena on /dev/shm",
                self.layout.path,
                error,
            )
            return
        self._registered_ptr = ptr

    @property
    def pinned(self) -> bool:
        return self._registered_ptr is not None

    def close(self) -> None:
        """Unregister from CUDA (callers first wait for every copy touching it) and drop the mapping."""
        if self._registered_ptr is not None:
            error = int(torch.cuda.cudart().cudaHostUnregister(self._registered_ptr))
            if error != 0:
                log.warning("cudaHostUnregister of the L1 arena failed (CUDA error %d)", error)
            self._registered_ptr = None
        self.slots = torch.empty(0, dtype=self.slots.dtype)
        self._raw = torch.empty(0, dtype=torch.uint8)
        # Still viewed by a tensor someone holds: the mapping then goes when the last such view does.
        with contextlib.suppress(BufferError):
            self._mmap.close()


def _drain_pending_cuda_error() -> None:
    """torch's cudart binding leaves a failed call's error pending, and the next kernel launch would report it
    as its own failure: launch one tiny kernel now and swallow that report."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except Exception:  # torch.AcceleratorError: the stale error, consumed by this check
        log.debug("drained the CUDA error left by cudaHostRegister")


def _map_existing(path: str, size: int) -> mmap.mmap:
    """Map an existing file shared, read-write. Never creates it: a missing arena is an error, not a new file."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:  # the file is gone, or the kvstore runs on another host
        raise ArenaMappingError(f"cannot map the arena {path}: {exc}") from exc
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ArenaMappingError(f"cannot map the arena {path}: {actual} bytes, expected {size}")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise ArenaMappingError(f"cannot map the arena {path}: {exc}") from exc
    finally:
        os.close(fd)  # the mapping outlives the descriptor
