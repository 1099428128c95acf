"""Which rank holds which block: block hash -> ranks holding it in L0 (their GPU prefix cache), and the set
of hashes the node's kvstore holds in L1.

Hashes are chained, so a prompt's cached prefix on a rank is the run of its lookup hashes, from the first,
that the rank holds. Each hash maps to a bitmask of rank slots (an int) rather than a set of names: one
small int per block instead of a set object, which matters at millions of blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from contracts.kv_events import KvEvent, KvEventKind


@dataclass(frozen=True)
class PrefixMatch:
    """For one rank: leading lookup hashes in its L0, then how many of the following ones L1 holds."""

    l0_blocks: int
    l1_blocks: int


class PrefixIndex:
    """L0 ownership per rank plus L1 presence, fed by KV events and queried per request."""

    def __init__(self) -> None:
        self._holders: dict[bytes, int] = {}  # hash -> bitmask of rank slots
        self._slot_of: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._rank_blocks: dict[str, set[bytes]] = {}  # to clear a rank without scanning every hash
        self._l1: set[bytes] = set()

    # --- L0, per rank ---

    def apply(self, rank_id: str, events: Iterable[KvEvent]) -> None:
        """Apply a rank's events in order."""
        for event in events:
            if event.kind is KvEventKind.STORED:
                self.stored(rank_id, event.block_hashes)
            elif event.kind is KvEventKind.REMOVED:
                self.removed(rank_id, event.block_hashes)
            else:
                self.clear_rank(rank_id)

    def stored(self, rank_id: str, block_hashes: Iterable[bytes]) -> None:
        bit = 1 << self._slot(rank_id)
        blocks = self._rank_blocks[rank_id]
        holders = self._holders
        for block_hash in block_hashes:
            holders[block_hash] = holders.get(block_hash, 0) | bit
            blocks.add(block_hash)

    def removed(self, rank_id: str, block_hashes: Iterable[bytes]) -> None:
        blocks = self._rank_blocks.get(rank_id)
        if blocks is None:
            return
        keep = ~(1 << self._slot_of[rank_id])
        for block_hash in block_hashes:
            if block_hash in blocks:
                blocks.discard(block_hash)
                self._drop_bit(block_hash, keep)

    def clear_rank(self, rank_id: str) -> None:
        """Forget everything a rank holds (a new incarnation, a resubscription, a forgotten rank)."""
        blocks = self._rank_blocks.pop(rank_id, None)
        slot = self._slot_of.pop(rank_id, None)
        if blocks is None or slot is None:
            return
        keep = ~(1 << slot)
        for block_hash in blocks:
            self._drop_bit(block_hash, keep)
        self._free_slots.append(slot)

    def l0_blocks(self, rank_id: str) -> int:
        return len(self._rank_blocks.get(rank_id, ()))

    # --- L1, the node's kvstore ---

    def apply_l1(self, events: Iterable[KvEvent]) -> None:
        for event in events:
            if event.kind is KvEventKind.STORED:
                self._l1.update(event.block_hashes)
            elif event.kind is KvEventKind.REMOVED:
                self._l1.difference_update(event.block_hashes)
            else:
                self._l1.clear()

    def clear_l1(self) -> None:
        self._l1.clear()

    @property
    def l1_blocks(self) -> int:
        return len(self._l1)

    # --- queries ---

    def match(self, lookup_hashes: Sequence[bytes], rank_ids: Iterable[str]) -> dict[str, PrefixMatch]:
        """Per rank: the leading run of lookup_hashes in its L0, then the L1 run that continues it."""
        wanted = list(rank_ids)
        leading = dict.fromkeys(wanted, 0)
        alive = 0  # bitmask of ranks whose run is still going
        bit_of: dict[str, int] = {}
        for rank_id in wanted:
            slot = self._slot_of.get(rank_id)
            if slot is not None:
                bit_of[rank_id] = 1 << slot
                alive |= 1 << slot
        position = 0
        for block_hash in lookup_hashes:
            if not alive:
                break
            still = alive & self._holders.get(block_hash, 0)
            if still != alive:
                for rank_id, bit in bit_of.items():
                    if alive & bit and not still & bit:
                        leading[rank_id] = position
            alive = still
            position += 1
        if alive:
            for rank_id, bit in bit_of.items():
                if alive & bit:
                    leading[rank_id] = position
        l1_runs: dict[int, int] = {}
        result: dict[str, PrefixMatch] = {}
        for rank_id in wanted:
            start = leading[rank_id]
            if start not in l1_runs:
                l1_runs[start] = self._l1_run(lookup_hashes, start)
            result[rank_id] = PrefixMatch(start, l1_runs[start])
        return result

    def _l1_run(self, lookup_hashes: Sequence[bytes], start: int) -> int:
        count = 0
        for block_hash in lookup_hashes[start:]:
            if block_hash not in self._l1:
                break
            count += 1
        return count

    def _slot(self, rank_id: str) -> int:
        slot = self._slot_of.get(rank_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
            self._slot_of[rank_id] = slot
            self._rank_blocks[rank_id] = set()
        return slot

    def _drop_bit(self, block_hash: bytes, keep: int) -> None:
        remaining = self._holders.get(block_hash, 0) & keep
        if remaining:
            self._holders[block_hash] = remaining
        else:
            self._holders.pop(block_hash, None)
