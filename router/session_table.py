"""Session stickiness: session id -> the rank that served its last turn, forgotten after an idle TTL.

This is the in-memory table every Route reads; router/durable_state.py mirrors it into Redis so a
restarted router keeps sending each session to the rank that holds its prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class SessionEntry:
    rank_id: str
    expires_at: float  # monotonic seconds


class SessionTable:
    """Entries in touch order: with one TTL for all, the oldest to expire is always at the front."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def rank_of(self, session_id: str, now: float) -> str | None:
        """The session's rank, or None when unknown or idle past its TTL."""
        entry = self._entries.get(session_id)
        if entry is None or entry.expires_at <= now:
            return None
        return entry.rank_id

    def entry(self, session_id: str, now: float) -> SessionEntry | None:
        entry = self._entries.get(session_id)
        return entry if entry is not None and entry.expires_at > now else None

    def record(self, session_id: str, rank_id: str, now: float) -> None:
        """This turn went to rank_id: remember it for another full TTL."""
        self._entries[session_id] = SessionEntry(rank_id, now + self.ttl_s)
        self._entries.move_to_end(session_id)

    def restore(self, session_id: str, rank_id: str, remaining_s: float, now: float) -> bool:
        """An entry read back from Redis; the one in memory wins if both exist. True if it was added."""
        if remaining_s <= 0 or session_id in self._entries:
            return False
        self._entries[session_id] = SessionEntry(rank_id, now + min(remaining_s, self.ttl_s))
        return True

    def purge_expired(self, now: float) -> int:
        """Drop expired entries from the front; restored entries may sit out of order, so a few can stay
        until they reach the front (rank_of still ignores them)."""
        dropped = 0
        while self._entries:
            session_id, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                break
            del self._entries[session_id]
            dropped += 1
        return dropped

    def live(self, now: float) -> Iterator[tuple[str, SessionEntry]]:
        """Every unexpired entry (for a write-back to Redis)."""
        for session_id, entry in list(self._entries.items()):
            if entry.expires_at > now:
                yield session_id, entry
