"""What the L1 tier needs from the kvstore, without naming the transport (kvstore_link.py is the gRPC one).

Every call raises L1StaleArenaError when the arena it names is gone (the kvstore restarted: attach again
and remap) and L1UnavailableError for anything else that went wrong (the tier then serves from L0 only).
Calls block: the tier makes them from its own threads (l1_calls.py, kvstore_watch.py), never from the
engine thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from contracts.kv_events import KvEventBatch
from rank_worker.l1.arena import ArenaLayout


class L1UnavailableError(RuntimeError):
    """The kvstore did not answer, or refused: L1 is down for now."""


class L1StaleArenaError(RuntimeError):
    """The arena named in the call no longer exists (the kvstore restarted)."""


class KvEventStream(Protocol):
    """The kvstore's KV events from one subscription: a snapshot batch first, then deltas. Iteration ends
    when the kvstore ends the stream (it is stopping) and raises L1UnavailableError when it breaks."""

    def __iter__(self) -> Iterator[KvEventBatch]: ...

    def cancel(self) -> None:
        """End the iteration from another thread."""
        ...


class KvStoreClient(Protocol):
    @property
    def address(self) -> str: ...

    def attach(self, slot_bytes: int, hash_namespace: bytes) -> ArenaLayout:
        """Announce this rank (a new incarnation drops the old one's pins) and learn the arena layout."""
        ...

    def allocate(self, arena_id: str, block_hashes: list[bytes]) -> list[int]:
        """A slot to write for each hash, pinned until commit/release; -1 = already stored or no room."""
        ...

    def reserve(self, arena_id: str, count: int) -> list[int]:
        """Up to count slots pinned for writing blocks named at commit (fewer when L1 has no room); also renews
        the pins of the slots this rank holds reserved, so a rank that keeps reserving keeps them."""
        ...

    def commit(
        self, arena_id: str, slots: list[int], *, gpu_holds: bool = False, block_hashes: list[bytes] | None = None
    ) -> None:
        """Written slots become stored blocks. gpu_holds: written through while the GPU pool holds the blocks
        (L1 may then evict them first, until they are offered again). block_hashes: None for allocated slots; for
        reserved ones the block written into each (one whose block L1 already has goes back to free)."""
        ...

    def lookup(self, arena_id: str, block_hashes: list[bytes]) -> list[int]:
        """Slots of the longest stored run of block_hashes from the first, pinned for reading until release."""
        ...

    def release(self, arena_id: str, slots: list[int], *, restored: bool = False) -> None:
        """Unpin slots after a read, or abandon uncommitted writes. restored: the read blocks were copied into
        the GPU pool (L1 then evicts them first while the GPU holds them)."""
        ...

    def current_arena_id(self) -> str:
        """The arena the kvstore serves now (a cheap probe: is the one we map still current?)."""
        ...

    def kv_events(self) -> KvEventStream:
        """Subscribe to the kvstore's KV events (what L1 holds, whoever wrote it)."""
        ...

    def close(self) -> None: ...
