"""One waiting sequence's restore from L1, while it is under way off the engine thread.

The cache manager starts it when a sequence about to be admitted has blocks in L1 past its L0 prefix; the
sequence then waits (SequenceStatus.WAITING_FOR_L1) while the tier's worker looks the blocks up. When the
answer comes, the engine thread copies the found slots into pool blocks and registers them as L0 entries;
the sequence is admitted at its next turn over its L0 prefix, now longer. A fetch that does not hear back
by its deadline is given up: the sequence computes those blocks instead.

A waiting sequence holds only its L0 prefix while its lookup is under way (HostFetch.held; a step or two),
never blocks for what it will compute. Once answered, the fetch holds the prefix and the restored blocks until
the sequence's admission takes them (as a rule in the same step: it is the warmest of the waiting), the
sequence leaves, or blocks run short (Scheduler._blocks_short: then they are idle entries again, so a held
restore never holds up the sequences that would give blocks back). Left idle, as they were until 2026-12-06,
other admissions of the same burst evicted them first (the free pool is short when restores come in bursts):
the CPU probe's 40 agents in bursts restored whole sessions and computed them all the same, L1 still holding
every block (bench/probes/l1_agents_cpu.py --together).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(eq=False)
class HostFetch:
    prefix: list[bytes]  # the sequence's L0 prefix when the fetch started: the restore extends it
    hashes: list[bytes]  # the blocks wanted, those that follow it
    room: Callable[[int], int]  # of `found` blocks L1 has, how many fit the pool now
    deadline: float  # the tier's clock
    expected: int = 0  # of `hashes`, the leading blocks L1's event stream said it held when the lookup began
    restored: set[int] = field(default_factory=set)  # pool blocks copied in from L1
    # The L0 blocks of `prefix`, referenced from the lookup's start until its answer (or its end otherwise):
    # unheld, admissions in the step or two a lookup takes evicted them (the oldest entries of a session
    # waiting for L1 are next to go), and a restore that no longer extends an L0 prefix restores nothing.
    # Once answered, the restored blocks too, until the admission takes them (KvCacheManager.attach_cached_prefix)
    held: list[int] = field(default_factory=list)
    cut: int = 0  # blocks the answer found that the free pool had no room for (released to L1)
    # Free blocks the answer will take (the restore L1 was known to hold and the next chunk), counted when it began:
    # until it is done, admissions and prefill chunks leave them (KvCacheManager.reserved_blocks)
    reserved: int = 0
    done: bool = False  # answered, given up or failed: the sequence may be admitted
    abandoned: bool = False  # the sequence is gone; an answer still to come is released


class PrefixPool(Protocol):
    def lookup(self, block_hash: bytes) -> int | None: ...

    def acquire_cached(self, block_id: int) -> None: ...

    def release(self, block_ids: list[int]) -> None: ...


def hold_prefix(pool: PrefixPool, prefix: list[bytes]) -> list[int] | None:
    """Reference the L0 blocks of `prefix` while blocks are taken for the restore (taking them could evict
    these); None, holding nothing, when one is gone already (what would be restored no longer extends it)."""
    blocks: list[int] = []
    for block_hash in prefix:
        block_id = pool.lookup(block_hash)
        if block_id is None:
            return None
        blocks.append(block_id)
    for block_id in blocks:
        pool.acquire_cached(block_id)
    return blocks


def release_held(pool: PrefixPool, fetch: HostFetch) -> None:
    """Let go of what the fetch holds (its prefix, and once answered its restored blocks), tail first so its head
    stays longest: idle L0 entries again."""
    held, fetch.held = fetch.held, []
    if held:
        pool.release(list(reversed(held)))
