"""Arena slots the kvstore has pinned for this rank with no block in them yet (its Reserve call), for exclusive
tiers (l1_write_through on_evict).

When the pool evicts a block L1 lacks, its bytes must be on their way to the host before the step that reuses
the block runs; a kvstore call is a thread hop and a gRPC round trip away, so the slot has to be in hand already.
The reservation is topped up off the engine thread (the tier submits a Reserve when it is half spent) and renewed
while idle: the kvstore drops a pin older than l1_pin_ttl_secs (120 s by default), and each Reserve restarts the
clock of every slot the rank holds reserved, so a renewal is a Reserve of what is missing, possibly nothing.
Evictions past what is in hand are lost (counted), never waited for.
"""

from __future__ import annotations

from rank_worker.l1.eviction_horizon import horizon_blocks_for

# A quarter of the kvstore's default pin TTL: an idle rank's reservation outlives a late or lost renewal.
RENEW_INTERVAL_S = 30.0
# After a Reserve gave fewer slots than asked (L1 all pinned, or the ranks' reservations at the kvstore's limit): the
# wait before asking again, rather than a call every step.
SHORT_RETRY_S = 1.0


def reserved_slots_for(setting: int | None, step_tokens: int, block_size: int) -> int:
    """The reservation's size: the setting (l1_reserved_slots) or, unset, the eviction horizon's default, twice the
    blocks a step of step_tokens allocates (at least 1024): topped up at half, so one step's evictions never run it
    dry, as a horizon pass every quarter comes before a step's allocation passes it."""
    return horizon_blocks_for(setting, step_tokens, block_size)


class SlotReserve:
    """The slots in hand and whether a Reserve is on its way; times come from the caller's clock."""

    def __init__(self, target: int, now: float, renew_interval_s: float = RENEW_INTERVAL_S) -> None:
        self.target = target
        self.renew_interval_s = renew_interval_s
        self._slots: list[int] = []
        self._asking = False
        self._asked_for = 0
        self._short = False  # the last answer gave fewer than asked
        self._renewed_at = now

    def __len__(self) -> int:
        return len(self._slots)

    def take(self, count: int) -> list[int]:
        """Up to count slots, out of the reservation for good (the caller commits or releases them)."""
        taken = self._slots[:count]
        del self._slots[:count]
        return taken

    def wanted(self, now: float) -> int | None:
        """How many slots to ask the kvstore for now: the shortfall once half is spent, 0 when only a renewal is
        due, None when no call is (one on its way, or neither due)."""
        if self._asking or self.target <= 0:
            return None
        if self._short and now - self._renewed_at < SHORT_RETRY_S:
            return None
        if len(self._slots) <= self.target // 2:
            return self.target - len(self._slots)
        if now - self._renewed_at >= self.renew_interval_s:
            return 0
        return None

    def asked(self, now: float, count: int) -> None:
        """A Reserve of count slots was submitted at `now` (it renews every slot in hand when it is answered)."""
        self._asking = True
        self._asked_for = count
        self._renewed_at = now

    def answered(self, slots: list[int]) -> None:
        self._asking = False
        self._short = len(slots) < self._asked_for
        self._slots.extend(slots)

    def failed(self) -> None:
        """The Reserve failed (the tier goes down and clears the reservation)."""
        self._asking = False

    def clear(self) -> list[int]:
        """L1 detached: what was in hand, forgotten here (the kvstore drops the pins: a new incarnation, or
        their TTL)."""
        slots, self._slots = self._slots, []
        self._asking = False
        return slots
