"""What the node's L1 holds, as the kvstore announces it: the block hashes of its KV event stream.

Every rank of a node shares one kvstore, so a rank that takes over another's sessions (a failover, an
overloaded rank) finds their blocks here although it never moved them itself, and schedules their turns as
warm. The view is a hint for scheduling, never a promise: a lookup on admission says what is really there.

Written by the watch thread, read by the engine thread: set membership and single updates are atomic in
CPython, and readers only ask membership.
"""

from __future__ import annotations

from collections.abc import Iterable

from contracts.kv_events import KvEvent, KvEventKind


class L1View:
    def __init__(self) -> None:
        self._stored: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._stored)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._stored

    def apply(self, events: Iterable[KvEvent]) -> None:
        for event in events:
            if event.kind is KvEventKind.ALL_CLEARED:
                self._stored = set()  # a fresh set: a reader mid-walk keeps the old one whole
            elif event.kind is KvEventKind.STORED:
                self._stored.update(event.block_hashes)
            elif event.kind is KvEventKind.REMOVED:
                self._stored.difference_update(event.block_hashes)

    def add(self, block_hashes: Iterable[bytes]) -> None:
        """Blocks this rank just committed (their STORED event follows shortly)."""
        self._stored.update(block_hashes)

    def clear(self) -> None:
        self._stored = set()

    def leading_run(self, block_hashes: list[bytes]) -> int:
        """How many of block_hashes, from the first, L1 holds as far as the view knows."""
        stored = self._stored
        count = 0
        for block_hash in block_hashes:
            if block_hash not in stored:
                break
            count += 1
        return count
