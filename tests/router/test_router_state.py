"""RouterState: registration, heartbeats, failures, sweeps and Route over the registry, index and sessions
(no gRPC: a fake clock and recording hooks)."""

from __future__ import annotations

import logging

import pytest
from router_prompts import lookup_hashes, prompt_tokens

from contracts.kv_events import KvEvent, KvEventKind
from router.rank_registry import RankIdentity, RankLoad, RegisterOutcome
from router.route_score import RoutePolicy
from router.router_state import FORGET_DOWN_RANK_AFTER_S, NoRankAvailableError, RouteQuery, RouterState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """Both hooks: which ranks are followed, which keys changed."""

    def __init__(self) -> None:
        self.followed: dict[str, str] = {}
        self.sessions: list[str] = []
        self.ranks: list[str] = []
        self.forgotten: list[str] = []

    def follow_rank(self, identity: RankIdentity) -> None:
        self.followed[identity.rank_id] = identity.incarnation

    def unfollow_rank(self, rank_id: str) -> None:
        self.followed.pop(rank_id, None)

    def session_changed(self, session_id: str) -> None:
        self.sessions.append(session_id)

    def rank_changed(self, rank_id: str) -> None:
        self.ranks.append(rank_id)

    def rank_forgotten(self, rank_id: str) -> None:
        self.forgotten.append(rank_id)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def state(clock: Clock, recorder: Recorder) -> RouterState:
    state = RouterState(RoutePolicy(0.05, 10_000), session_ttl_s=60, rank_down_after_s=5, clock=clock)
    state.follower = recorder
    state.durable = recorder
    return state


def register(state: RouterState, rank_id: str, incarnation: str = "i1", waiting: int = 0) -> RegisterOutcome:
    identity = RankIdentity(rank_id, f"{rank_id}.local:5000", incarnation, 16, b"\0" * 16)
    return state.register_rank(identity, RankLoad(waiting_prefill_tokens=waiting))


def query(tokens: list[int], session: str = "", avoid: frozenset[str] = frozenset()) -> RouteQuery:
    return RouteQuery("req", session, lookup_hashes(tokens), len(tokens), avoid)


def test_register_follows_the_rank_and_records_it(state: RouterState, recorder: Recorder) -> None:
    assert register(state, "a") is RegisterOutcome.NEW
    assert recorder.followed == {"a": "i1"} and recorder.ranks == ["a"]
    assert register(state, "a") is RegisterOutcome.SAME_INCARNATION
    assert recorder.ranks == ["a"], "nothing durable changed"


def test_new_incarnation_clears_the_ranks_prefix_entries(state: RouterState, recorder: Recorder) -> None:
    register(state, "a")
    tokens = prompt_tokens(1, 161)
    state.apply_rank_events("a", "i1", [KvEvent(KvEventKind.STORED, tuple(lookup_hashes(tokens)))])
    assert state.index.l0_blocks("a") == 10
    state.apply_rank_events("a", "stale-incarnation", [KvEvent(KvEventKind.ALL_CLEARED)])
    assert state.index.l0_blocks("a") == 10, "events of another incarnation are ignored"
    assert register(state, "a", incarnation="i2") is RegisterOutcome.NEW_INCARNATION
    assert state.index.l0_blocks("a") == 0
    assert recorder.followed == {"a": "i2"} and recorder.ranks == ["a", "a"]


def test_route_follows_the_prefix_then_the_session(state: RouterState, clock: Clock) -> None:
    register(state, "a")
    register(state, "b")
    turn1 = prompt_tokens(1, 800)
    state.apply_rank_events("b", "i1", [KvEvent(KvEventKind.STORED, tuple(lookup_hashes(turn1)[:40]))])
    answer = state.route(query([*turn1, 1, 2, 3], session="s1"))
    assert (answer.choice.rank_id, answer.choice.reason, answer.choice.expected_l0_tokens) == ("b", "prefix", 640)
    assert answer.address == "b.local:5000"
    clock.now += 1
    again = state.route(query(prompt_tokens(9, 300), session="s1"))  # unrelated prompt, same session
    assert (again.choice.rank_id, again.choice.reason) == ("b", "session")


def test_optimistic_load_spreads_a_burst_of_new_sessions(state: RouterState) -> None:
    register(state, "a")
    register(state, "b")
    chosen = [state.route(query(prompt_tokens(n, 4000), session=f"s{n}")).choice.rank_id for n in range(4)]
    assert sorted(chosen) == ["a", "a", "b", "b"], chosen
    state.heartbeat("a", "i1", RankLoad())
    state.heartbeat("b", "i1", RankLoad(waiting_prefill_tokens=100_000))
    assert state.route(query(prompt_tokens(9, 100))).choice.rank_id == "a"


def test_warm_turn_stays_on_a_rank_busy_with_cold_prefills(state: RouterState, clock: Clock) -> None:
    register(state, "a")
    register(state, "b")
    history = prompt_tokens(1, 800)
    state.apply_rank_events("a", "i1", [KvEvent(KvEventKind.STORED, tuple(lookup_hashes(history)[:50]))])
    assert state.route(query(history, session="s1")).choice.rank_id == "a"
    # "a" is past the overload limit with new sessions' cold prefills, none of which a warm turn waits for.
    state.heartbeat("a", "i1", RankLoad(waiting_prefill_tokens=50_000, waiting_warm_prefill_tokens=200))
    clock.now += 1
    turn = state.route(query([*history, *prompt_tokens(2, 64)], session="s1"))
    assert (turn.choice.rank_id, turn.choice.reason, turn.choice.warm) == ("a", "session", True)
    entry = state.registry.get("a")
    assert entry is not None and entry.queued_warm_prefill_tokens == 200 + turn.choice.new_prefill_tokens
    # Once the warm part itself is past the limit, the session leaves for the idle rank.
    state.heartbeat("a", "i1", RankLoad(waiting_prefill_tokens=50_000, waiting_warm_prefill_tokens=40_000))
    moved = state.route(query([*history, *prompt_tokens(2, 64)], session="s1"))
    assert (moved.choice.rank_id, moved.choice.reason) == ("b", "overloaded-session-rank")


def test_session_moves_when_its_rank_is_down_or_avoided(state: RouterState, recorder: Recorder) -> None:
    register(state, "a")
    register(state, "b")
    first = state.route(query(prompt_tokens(1, 100), session="s")).choice.rank_id
    other = "b" if first == "a" else "a"
    moved = state.route(query(prompt_tokens(1, 120), session="s", avoid=frozenset({first})))
    assert moved.choice.rank_id == other and moved.choice.reason == "only-rank"
    assert state.sessions.rank_of("s", state.now()) == other, "the session follows to its new rank"
    assert state.report_failure(other, "connection refused")
    assert recorder.followed.keys() == {first}, "a down rank's feed stops"
    assert state.route(query(prompt_tokens(1, 140), session="s")).choice.rank_id == first
    assert recorder.sessions == ["s", "s", "s"]


def test_no_healthy_rank_is_unavailable(state: RouterState) -> None:
    with pytest.raises(NoRankAvailableError):
        state.route(query(prompt_tokens(1, 10)))
    register(state, "a")
    with pytest.raises(NoRankAvailableError):
        state.route(query(prompt_tokens(1, 10), avoid=frozenset({"a"})))


def test_sweep_marks_silent_ranks_down_and_forgets_them_later(
    state: RouterState, clock: Clock, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    register(state, "a")
    register(state, "b")
    clock.now += 4
    state.heartbeat("b", "i1", RankLoad())
    clock.now += 2
    with caplog.at_level(logging.WARNING, logger="router"):
        state.sweep()
    assert [entry.rank_id for entry in state.registry.healthy()] == ["b"]
    assert "rank a marked down: no heartbeat for 6.0s" in caplog.text
    assert not state.heartbeat("a", "i1", RankLoad()), "a down rank re-registers"
    clock.now += FORGET_DOWN_RANK_AFTER_S + 1
    state.heartbeat("b", "i1", RankLoad())
    state.sweep()
    assert state.registry.get("a") is None and recorder.forgotten == ["a"]


def test_feed_lost_marks_down_only_the_incarnation_it_followed(state: RouterState) -> None:
    register(state, "a", incarnation="i2")
    state.feed_lost("a", "i1", "UNAVAILABLE")
    assert state.registry.healthy()
    state.feed_lost("a", "i2", "UNAVAILABLE")
    assert not state.registry.healthy()


def test_restored_rank_routes_once_it_heartbeats(state: RouterState, recorder: Recorder) -> None:
    state.restore_rank(RankIdentity("a", "127.0.0.1:5001", "i1", 16, b""))
    assert recorder.followed == {"a": "i1"}, "its events are followed right away"
    state.sessions.restore("s", "a", remaining_s=30, now=state.now())
    with pytest.raises(NoRankAvailableError):
        state.route(query(prompt_tokens(1, 10), session="s"))
    assert state.heartbeat("a", "i1", RankLoad())
    assert state.route(query(prompt_tokens(1, 10), session="s")).choice.reason == "session"


def test_every_line_about_a_request_names_its_id(state: RouterState, caplog: pytest.LogCaptureFixture) -> None:
    register(state, "a")
    with caplog.at_level(logging.INFO, logger="router"):
        state.route(query(prompt_tokens(1, 50), session="s"))
        state.report_failure("a", "connection refused", "msg_1+3")
        with pytest.raises(NoRankAvailableError):
            state.route(query(prompt_tokens(1, 50), session="s"))
    lines = [record.getMessage() for record in caplog.records if "request=" in record.getMessage()]
    assert len(lines) == 3, lines
    assert lines[0].startswith("route request=req session=s rank=a reason=only-rank "), "one line per decision"
    assert lines[1] == "rank a marked down: reported failed by request=msg_1+3: connection refused"
    assert lines[2].startswith("route request=req: no healthy rank to route to")


def test_queued_work_is_the_ranks_uncached_report_plus_what_was_routed_since_counted_once(
    state: RouterState, clock: Clock
) -> None:
    register(state, "a")
    in_l0, in_l1 = prompt_tokens(1, 4000), prompt_tokens(2, 4000)  # 250 blocks each, cached by earlier turns
    state.apply_rank_events("a", "i1", [KvEvent(KvEventKind.STORED, tuple(lookup_hashes([*in_l0, 0])))])
    state.index.apply_l1([KvEvent(KvEventKind.STORED, tuple(lookup_hashes([*in_l1, 0])))])
    # The rank's report for ten waiting warm turns of 4,000 cached + 3 new tokens: 30 tokens to compute.
    state.heartbeat("a", "i1", RankLoad(waiting=10, waiting_prefill_tokens=30, waiting_warm_prefill_tokens=30))
    warm = state.route(query([*in_l0, 1, 2, 3], session="s1")).choice
    assert warm.score == 3 + 30, "3 new tokens over a 30-token queue; neither counts a cached prefix"
    restorable = state.route(query([*in_l1, 1, 2, 3], session="s2")).choice
    assert restorable.expected_l1_tokens == 4000 and restorable.new_prefill_tokens == 3 + 200  # 4,000 x 0.05
    assert restorable.score == restorable.new_prefill_tokens + 30 + 3
    entry = state.registry.get("a")
    assert entry is not None
    assert entry.queued_prefill_tokens == entry.queued_warm_prefill_tokens == 30 + 3 + 203
    # The rank now reports both turns in the same unit; what the router had added for them is dropped.
    clock.now += 1
    state.heartbeat("a", "i1", RankLoad(waiting=12, waiting_prefill_tokens=236, waiting_warm_prefill_tokens=236))
    assert entry.queued_prefill_tokens == entry.queued_warm_prefill_tokens == 236
