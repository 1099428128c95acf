"""The EPP's choice of node, as a pure function of the nodes' cache matches and load: gateway/epp/picker.py feeds it
from the live fleet, simulator/nodes.py from the simulated one.

A fleet of nodes (each one kvserve stack: gateway, router, R ranks, one L1 host cache) sits behind an Envoy
gateway whose Endpoint Picker chooses the node of each request; inside the node its router chooses the rank as
router/route_score.py does (the constants both weigh: contracts/placement.py). Policies:

- `prefix`: the prefix-aware EPP. A session's turn stays on the node of its last turn (sticky) unless that node is
  overloaded (its prefill still to do per rank, ahead of a warm turn, at least `overload_prefill_tokens`) and
  another node's score is at most `escape_score_ratio` of it (the node sheds the session). A new session goes to
  the node with the lowest score: its new prefill (uncached tokens, tokens its best rank's L0 holds at 0 and those
  its L1 holds at `l1_restore_cost`) plus its queue per rank, nodes not overloaded first.
- `round_robin`: each request to the next node in turn (a plain Envoy load balancer).
- `least_loaded`: each request to the node with the least queued prefill per rank, then the fewest running
  sequences per rank (no prefix knowledge, no stickiness).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contracts.config import DEFAULTS
from contracts.placement import ESCAPE_SCORE_RATIO, RUNNING_SEQUENCE_TOKENS, WARM_PREFIX_FRACTION

NODE_CHOICES = ("prefix", "round_robin", "least_loaded")


@dataclass(frozen=True)
class NodePolicy:
    name: str = "prefix"  # one of NODE_CHOICES
    l1_restore_cost: float = DEFAULTS.scheduling.l1_restore_cost
    overload_prefill_tokens: int = DEFAULTS.overload_prefill_tokens  # per rank, as the node router's bar
    running_sequence_tokens: int = RUNNING_SEQUENCE_TOKENS
    escape_score_ratio: float = ESCAPE_SCORE_RATIO
    warm_prefix_fraction: float = WARM_PREFIX_FRACTION

    def __post_init__(self) -> None:
        if self.name not in NODE_CHOICES:
            raise ValueError(f"node choice {self.name!r}: one of {', '.join(NODE_CHOICES)}")


@dataclass(frozen=True)
class NodeCandidate:
    """One node as the EPP sees it."""

    node_id: str
    ranks: int
    l0_tokens: int  # leading prompt tokens the node's best rank holds in L0
    l1_tokens: int  # the tokens after those that the node's L1 holds
    queued_prefill_tokens: int  # over all its ranks: reported waiting prefill plus what was sent there since
    queued_warm_prefill_tokens: int  # the part of it a warm request waits for
    running: int  # running sequences over all its ranks


@dataclass(frozen=True)
class NodeChoice:
    node_id: str
    reason: str  # "session", "overloaded-session-node", "prefix", "load", "round-robin", "least-loaded", "only-node"
    new_prefill_tokens: int  # what the request adds to the node's queue (uncached + weighted L1 tokens)
    warm: bool


@dataclass(frozen=True)
class _Scored:
    candidate: NodeCandidate
    l0_tokens: int
    l1_tokens: int
    new_prefill: float
    queue: float  # per rank
    warm: bool
    overloaded: bool  # the prefill ahead of it per rank reaches the bar

    @property
    def score(self) -> float:
        return self.new_prefill + self.queue

    @property
    def cached_tokens(self) -> int:
        return self.l0_tokens + self.l1_tokens


def _score(candidate: NodeCandidate, prompt_tokens: int, policy: NodePolicy) -> _Scored:
    prompt_tokens = max(prompt_tokens, 0)
    l0 = min(candidate.l0_tokens, prompt_tokens)
    l1 = min(candidate.l1_tokens, prompt_tokens - l0)
    new_prefill = prompt_tokens - l0 - l1 + l1 * policy.l1_restore_cost
    warm = prompt_tokens > 0 and l0 + l1 >= policy.warm_prefix_fraction * prompt_tokens
    ranks = max(1, candidate.ranks)
    ahead = (
        min(candidate.queued_warm_prefill_tokens, candidate.queued_prefill_tokens)
        if warm
        else candidate.queued_prefill_tokens
    )
    queue = (ahead + candidate.running * policy.running_sequence_tokens) / ranks
    # Overloaded as the node router judges a session's rank: by the prefill ahead of the turn (here per rank).
    overloaded = ahead / ranks >= policy.overload_prefill_tokens
    return _Scored(candidate, l0, l1, new_prefill, queue, warm, overloaded)


def _load(item: _Scored) -> tuple[float, float, str]:
    ranks = max(1, item.candidate.ranks)
    return (item.candidate.queued_prefill_tokens / ranks, item.candidate.running / ranks, item.candidate.node_id)


def _order(item: _Scored) -> tuple[float, float, str]:
    return (item.score, item.queue, item.candidate.node_id)


def _choice(item: _Scored, reason: str) -> NodeChoice:
    return NodeChoice(item.candidate.node_id, reason, round(item.new_prefill), item.warm)


def choose_node(
    candidates: Sequence[NodeCandidate],
    prompt_tokens: int,
    session_node_id: str | None,
    policy: NodePolicy,
    turn: int = 0,
) -> NodeChoice | None:
    """The node for one request, or None without candidates. `session_node_id`: where the session's last turn
    went (None for a new session); `turn`: the EPP's request counter (round robin)."""
    if not candidates:
        return None
    scored = [_score(candidate, prompt_tokens, policy) for candidate in candidates]
    if len(scored) == 1:
        return _choice(scored[0], "only-node")
    if policy.name == "round_robin":
        return _choice(scored[turn % len(scored)], "round-robin")
    if policy.name == "least_loaded":
        return _choice(min(scored, key=_load), "least-loaded")
    session = next((item for item in scored if item.candidate.node_id == session_node_id), None)
    if session is not None:
        if not session.overloaded:
            return _choice(session, "session")
        others = [item for item in scored if item is not session]
        best_other = min(others, key=_order)
        if best_other.score <= session.score * policy.escape_score_ratio:
            return _choice(best_other, "overloaded-session-node")
        return _choice(session, "session")
    fit = [item for item in scored if not item.overloaded] or scored  # shed: overloaded nodes only when all are
    best = min(fit, key=_order)
    least_cached = min(item.cached_tokens for item in scored)
    return _choice(best, "prefix" if best.cached_tokens > least_cached else "load")
