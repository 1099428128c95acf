"""The routing decision, as a pure function of the candidates' cache matches and load.

score = new prefill work on that rank + work queued there ahead of it (lower is better), where a token held
in L0 costs nothing, a token restored from L1 costs l1_restore_cost of a prefilled one, and each running
sequence adds a fixed amount because decode steps share the GPU with the prefill.

Queued work is in the same unit: ranks report the prefill still to do on them (prompt tokens not in L0, those
restorable from L1 at l1_restore_cost), and the router adds each request it routed there since the last
heartbeat at its own new_prefill. A cached prefix is never counted as work, here or on the rank.

"Ahead of it" follows the rank's warm_first scheduler: a request the rank will find warm (at least
warm_prefix_fraction of its prompt cached in L0 or L1) is taken before waiting cold prefills, so it queues
only behind the warm part of the queue. A session's rank busy with new sessions' cold prefills is therefore
not overloaded for the session's next turn, and the turn stays where its prefix is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contracts.placement import ESCAPE_SCORE_RATIO, RUNNING_SEQUENCE_TOKENS, WARM_PREFIX_FRACTION


@dataclass(frozen=True)
class RoutePolicy:
    l1_restore_cost: float
    overload_prefill_tokens: int
    running_sequence_tokens: int = RUNNING_SEQUENCE_TOKENS
    escape_score_ratio: float = ESCAPE_SCORE_RATIO
    warm_prefix_fraction: float = WARM_PREFIX_FRACTION


@dataclass(frozen=True)
class Candidate:
    """One healthy rank the request may go to."""

    rank_id: str
    block_size: int
    l0_blocks: int  # leading lookup hashes in the rank's L0
    l1_blocks: int  # lookup hashes after those that the node's L1 holds
    queued_prefill_tokens: int  # reported waiting prefill plus what we routed there since
    running: int
    queued_warm_prefill_tokens: int  # the part of it a warm request waits for (the rest is cold prefill)


@dataclass(frozen=True)
class ScoredCandidate:
    candidate: Candidate
    l0_tokens: int
    l1_tokens: int
    uncached_tokens: int  # prompt tokens the rank must compute
    new_prefill: float  # uncached tokens plus the weighted cost of restoring the L1 ones
    queue: float
    warm: bool  # the rank's scheduler will take it as a warm request
    queued_ahead: int  # waiting prefill tokens it queues behind

    @property
    def score(self) -> float:
        return self.new_prefill + self.queue

    @property
    def cached_tokens(self) -> int:
        return self.l0_tokens + self.l1_tokens


@dataclass(frozen=True)
class RouteChoice:
    rank_id: str
    reason: str  # "session", "overloaded-session-rank", "prefix", "load", "only-rank"
    expected_l0_tokens: int
    expected_l1_tokens: int
    score: float
    new_prefill_tokens: int  # its new_prefill, in the unit ranks report their queue in (the optimistic estimate)
    warm: bool = False  # expected warm on that rank (its prefill joins the warm part of the queue)


def score_candidate(candidate: Candidate, prompt_tokens: int, policy: RoutePolicy) -> ScoredCandidate:
    """Expected work for `candidate` to start this prompt, in prefill-token units."""
    prompt_tokens = max(prompt_tokens, 0)
    l0_tokens = min(candidate.l0_blocks * candidate.block_size, prompt_tokens)
    l1_tokens = min(candidate.l1_blocks * candidate.block_size, prompt_tokens - l0_tokens)
    uncached = prompt_tokens - l0_tokens - l1_tokens
    new_prefill = uncached + l1_tokens * policy.l1_restore_cost
    warm = prompt_tokens > 0 and l0_tokens + l1_tokens >= policy.warm_prefix_fraction * prompt_tokens
    ahead = (
        min(candidate.queued_warm_prefill_tokens, candidate.queued_prefill_tokens)
        if warm
        else candidate.queued_prefill_tokens
    )
    queue = ahead + candidate.running * policy.running_sequence_tokens
    return ScoredCandidate(candidate, l0_tokens, l1_tokens, uncached, new_prefill, queue, warm, ahead)


def choose_rank(
    candidates: Sequence[Candidate], prompt_tokens: int, session_rank_id: str | None, policy: RoutePolicy
) -> RouteChoice | None:
    """The rank for one request, or None when there is no candidate. `session_rank_id`: where the
    session's previous turn went (None for no session or a new one)."""
    if not candidates:
        return None
    scored = [score_candidate(candidate, prompt_tokens, policy) for candidate in candidates]
    best = min(scored, key=_order)
    session = next((item for item in scored if item.candidate.rank_id == session_rank_id), None)
    if session is not None:
        if session.queued_ahead < policy.overload_prefill_tokens:
            return _choice(session, "session")
        others = [item for item in scored if item is not session]
        if others:
            best_other = min(others, key=_order)
            if best_other.score <= session.score * policy.escape_score_ratio:
                return _choice(best_other, "overloaded-session-rank")
        return _choice(session, "session")
    if len(scored) == 1:
        return _choice(best, "only-rank")
    # The cache decided when the chosen rank has more of the prompt cached than some other candidate.
    least_cached = min(item.cached_tokens for item in scored)
    return _choice(best, "prefix" if best.cached_tokens > least_cached else "load")


def _order(item: ScoredCandidate) -> tuple[float, float, str]:
    # Ties: the emptier queue, then the name, so equal ranks get a stable answer.
    return (item.score, item.queue, item.candidate.rank_id)


def _choice(item: ScoredCandidate, reason: str) -> RouteChoice:
    return RouteChoice(
        rank_id=item.candidate.rank_id,
        reason=reason,
        expected_l0_tokens=item.l0_tokens,
        expected_l1_tokens=item.l1_tokens,
        score=item.score,
        new_prefill_tokens=round(item.new_prefill),
        warm=item.warm,
    )
