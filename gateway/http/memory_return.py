"""Giving memory back to the system after a large request body.

Parsing tens of megabytes of JSON leaves the freed memory with the allocator: glibc keeps it in its heaps
(worker threads get heaps of their own), so without help the gateway's RSS stays at its high-water mark
(2.6 GB after two 31 MB bodies). A collection frees what cycles hold (an exception's traceback keeps the
parsing frames' locals), and malloc_trim returns the free pages."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
from collections.abc import Callable

_trimming = threading.Lock()


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


def return_memory() -> bool:
    """Collect and trim; False when another call is already doing it (one is enough)."""
    if not _trimming.acquire(blocking=False):
        return False
    try:
        gc.unfreeze()  # what a large body's work froze (body_parse) is collectable again
        gc.collect()
        if _malloc_trim is not None:
            _malloc_trim(0)
        return True
    finally:
        _trimming.release()
