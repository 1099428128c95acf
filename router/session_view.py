"""The per-session view (`kvserve sessions`): for each session the gateways reported finished requests of, its
calls, prompt tokens found in L0, restored from L1 and computed, cache hit, cold prefills and its rank.

A view, not state: it lives in the router's memory only (a restarted router starts it empty; Redis keeps the
session -> rank stickiness, not this), holds at most `max_sessions` (the least recently seen are dropped) and
is never read for routing. The gateway reports each request after it ended (router.proto ReportFinished)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_SESSIONS = 10_000


@dataclass(frozen=True)
class FinishedCall:
    """One finished request of a session, as the gateway reports it (checked: counts >= 0, l0 + l1 <= prompt)."""

    session_id: str
    rank_id: str
    prompt_tokens: int
    l0_cached_tokens: int
    l1_cached_tokens: int
    output_tokens: int


@dataclass
class SessionStats:
    session_id: str
    rank_id: str  # the rank of its last call
    first_seen: float  # unix seconds
    last_seen: float
    calls: int = 0
    prompt_tokens: int = 0
    l0_cached_tokens: int = 0
    l1_cached_tokens: int = 0
    output_tokens: int = 0
    cold_prefills: int = 0
    rank_ids: set[str] = field(default_factory=set)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens prefilled: neither in L0 nor restored from L1."""
        return self.prompt_tokens - self.l0_cached_tokens - self.l1_cached_tokens

    @property
    def cache_hit(self) -> float:
        """The share of its prompt tokens served from a cache tier, over all its calls (0 with no prompt)."""
        if self.prompt_tokens <= 0:
            return 0.0
        return (self.l0_cached_tokens + self.l1_cached_tokens) / self.prompt_tokens


def cold_call(call: FinishedCall, warm_prefix_fraction: float) -> bool:
    """A cold prefill: less than the warm fraction of the prompt cached (the rank scheduler's and the router's
    warm test, route_score.warm; a session's first call is usually one)."""
    cached = call.l0_cached_tokens + call.l1_cached_tokens
    return call.prompt_tokens > 0 and cached < warm_prefix_fraction * call.prompt_tokens


class SessionView:
    """Sessions in last-seen order (the oldest at the front), at most max_sessions of them."""

    def __init__(
        self,
        warm_prefix_fraction: float,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.warm_prefix_fraction = warm_prefix_fraction
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, SessionStats] = OrderedDict()
        self.dropped = 0  # sessions pushed out by the bound

    def __len__(self) -> int:
        return len(self._sessions)

    def report(self, call: FinishedCall) -> SessionStats:
        """Count one finished call; the session becomes the most recently seen."""
        now = self._clock()
        stats = self._sessions.get(call.session_id)
        if stats is None:
            stats = SessionStats(call.session_id, call.rank_id, first_seen=now, last_seen=now)
            self._sessions[call.session_id] = stats
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
                self.dropped += 1
        else:
            self._sessions.move_to_end(call.session_id)
        stats.rank_id = call.rank_id
        stats.rank_ids.add(call.rank_id)
        stats.last_seen = max(stats.last_seen, now)
        stats.calls += 1
        stats.prompt_tokens += call.prompt_tokens
        stats.l0_cached_tokens += call.l0_cached_tokens
        stats.l1_cached_tokens += call.l1_cached_tokens
        stats.output_tokens += call.output_tokens
        if cold_call(call, self.warm_prefix_fraction):
            stats.cold_prefills += 1
        return stats

    def newest(self, limit: int = 0) -> list[SessionStats]:
        """The most recently seen sessions first; limit <= 0: all of them."""
        count = len(self._sessions) if limit <= 0 else min(limit, len(self._sessions))
        result: list[SessionStats] = []
        for stats in reversed(self._sessions.values()):
            if len(result) == count:
                break
            result.append(stats)
        return result
