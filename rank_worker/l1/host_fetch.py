"""One waiting sequence's restore from L1, while it is under way off the engine thread.

The cache manager starts it when a sequence about to be admitted has blocks in L1 past its L0 prefix; the
sequence then waits (SequenceStatus.WAITING_FOR_L1) while the tier's worker looks the blocks up. When the
answer comes, the engine thread copies the found slots into pool blocks and registers them as L0 entries;
the sequence is admitted at its next turn over its L0 prefix, now longer. A fetch that does not hear back
by its deadline is given up: the sequence computes those blocks instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class HostFetch:
    hashes: list[bytes]  # the blocks wanted, those that follow the sequence's L0 prefix
    room: Callable[[int], int]  # of `found` blocks L1 has, how many fit the pool now
    deadline: float  # the tier's clock
    # Pool blocks referenced on the sequence's behalf until it is admitted (the L0 prefix, then what is
    # restored), so L0 cannot evict them meanwhile; the cache manager lets go of them.
    held: list[int] = field(default_factory=list)
    restored: set[int] = field(default_factory=set)  # pool blocks copied in from L1
    done: bool = False  # answered, given up or failed: the sequence may be admitted
    abandoned: bool = False  # the sequence is gone; an answer still to come is released

    @property
    def restored_blocks(self) -> int:
        return len(self.restored)
