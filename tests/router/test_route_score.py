"""The routing decision: every reason, the overloaded-session escape, load balancing of new sessions."""

from __future__ import annotations

from router.route_score import Candidate, RoutePolicy, choose_rank, score_candidate

POLICY = RoutePolicy(l1_restore_cost=0.05, overload_prefill_tokens=10_000)


def rank(rank_id: str, l0: int = 0, l1: int = 0, queued: int = 0, running: int = 0) -> Candidate:
    """A rank whose whole queue is ahead of any request (as under fifo scheduling)."""
    return Candidate(rank_id, 16, l0, l1, queued, running, queued)


def test_no_candidate_no_choice() -> None:
    assert choose_rank([], 100, None, POLICY) is None


def test_only_rank() -> None:
    choice = choose_rank([rank("a", l0=2)], 100, None, POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("a", "only-rank")
    assert choice.expected_l0_tokens == 32


def test_new_session_goes_to_the_less_loaded_rank() -> None:
    candidates = [rank("busy", queued=5000), rank("idle", queued=100), rank("running", running=30)]
    choice = choose_rank(candidates, 2000, None, POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("idle", "load")


def test_prefix_wins_over_a_small_load_difference() -> None:
    candidates = [rank("cached", l0=100, queued=500), rank("empty")]
    choice = choose_rank(candidates, 1700, None, POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("cached", "prefix")
    assert (choice.expected_l0_tokens, choice.expected_l1_tokens) == (1600, 0)
    assert choice.new_prefill_tokens == 100


def test_a_huge_queue_beats_the_prefix() -> None:
    candidates = [rank("cached", l0=10, queued=50_000), rank("empty")]
    choice = choose_rank(candidates, 400, None, POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("empty", "load")


def test_l1_restore_is_cheap_but_not_free() -> None:
    # Both ranks see the node's L1; the one with the L0 run is better by the restore cost of those blocks.
    candidates = [rank("l0", l0=10, l1=0), rank("l1-only", l0=0, l1=10)]
    scored = {c.rank_id: score_candidate(c, 200, POLICY) for c in candidates}
    assert scored["l1-only"].score - scored["l0"].score == 160 * 0.05
    choice = choose_rank(candidates, 200, None, POLICY)
    assert choice is not None and choice.rank_id == "l0" and choice.reason == "load", "equal cached tokens"
    assert choose_rank([rank("l1-only", l1=10)], 200, None, POLICY).expected_l1_tokens == 160  # type: ignore[union-attr]


def test_the_load_estimate_of_a_routed_request_is_its_new_prefill_in_the_ranks_unit() -> None:
    # Ranks report queued work as tokens to compute, L1 hits at l1_restore_cost: the router's estimate of a
    # request it sends them must be the same number, or the queue it adds to is in another unit.
    choice = choose_rank([rank("a", l0=5, l1=10, queued=30)], 250, None, POLICY)
    assert choice is not None and (choice.expected_l0_tokens, choice.expected_l1_tokens) == (80, 160)
    assert choice.new_prefill_tokens == 10 + round(160 * 0.05)
    assert choice.score == choice.new_prefill_tokens + 30, "the queue is added once, as reported"


def test_expected_tokens_never_exceed_the_prompt() -> None:
    scored = score_candidate(rank("a", l0=100, l1=100), 50, POLICY)
    assert (scored.l0_tokens, scored.l1_tokens, scored.uncached_tokens) == (50, 0, 0)


def test_session_sticks_to_its_rank_even_when_another_is_better() -> None:
    candidates = [rank("mine", queued=5000), rank("idle", l0=50)]
    choice = choose_rank(candidates, 800, "mine", POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("mine", "session")


def test_overloaded_session_rank_escapes_to_a_clearly_better_rank() -> None:
    candidates = [rank("mine", l0=60, queued=40_000), rank("idle")]
    choice = choose_rank(candidates, 1000, "mine", POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("idle", "overloaded-session-rank")


def test_overloaded_session_rank_stays_when_others_are_no_better() -> None:
    candidates = [rank("mine", l0=60, queued=12_000), rank("also-busy", queued=11_000)]
    choice = choose_rank(candidates, 1000, "mine", POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("mine", "session")


def test_session_rank_not_a_candidate_falls_back_to_scoring() -> None:
    choice = choose_rank([rank("a", queued=10), rank("b")], 100, "gone", POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("b", "load")


def test_ties_are_stable() -> None:
    first = choose_rank([rank("b"), rank("a")], 100, None, POLICY)
    second = choose_rank([rank("a"), rank("b")], 100, None, POLICY)
    assert first is not None and second is not None and first.rank_id == second.rank_id == "a"


def test_warm_turn_waits_only_for_the_warm_part_of_the_queue() -> None:
    # The session's rank is busy with cold prefills of new sessions; its warm_first scheduler takes this
    # turn (its prefix is in L0) before them, so the rank is not overloaded for it and the session stays.
    mine = Candidate("mine", 16, 60, 0, 40_000, 0, 500)
    choice = choose_rank([mine, rank("idle")], 1000, "mine", POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("mine", "session") and choice.warm
    assert score_candidate(mine, 1000, POLICY).queued_ahead == 500


def test_warm_queue_past_the_limit_still_lets_the_session_escape() -> None:
    mine = Candidate("mine", 16, 60, 0, 40_000, 0, 30_000)
    choice = choose_rank([mine, rank("idle")], 1000, "mine", POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("idle", "overloaded-session-rank")
    assert not choice.warm, "cold on the idle rank"


def test_a_cold_request_queues_behind_everything() -> None:
    # Under half the prompt cached: the rank's scheduler takes it as cold, after every waiting prefill.
    busy = Candidate("busy", 16, 20, 0, 40_000, 0, 500)
    scored = score_candidate(busy, 1000, POLICY)
    assert not scored.warm and scored.queued_ahead == 40_000
    choice = choose_rank([busy, rank("idle")], 1000, "busy", POLICY)
    assert choice is not None and (choice.rank_id, choice.reason) == ("idle", "overloaded-session-rank")


def test_l1_blocks_make_a_request_warm_too() -> None:
    # The rank's scheduler counts what the node's L1 holds as cached when it judges warm.
    other = Candidate("other", 16, 0, 60, 40_000, 0, 0)
    scored = score_candidate(other, 1000, POLICY)
    assert scored.warm and scored.queued_ahead == 0


def test_warm_queue_is_never_taken_as_more_than_the_whole_queue() -> None:
    odd = Candidate("odd", 16, 60, 0, 100, 0, 900)
    assert score_candidate(odd, 1000, POLICY).queued_ahead == 100
