"""Nodes across a network, tested on one machine (issue 37): two kvserve nodes, each a network namespace running a
whole `kvserve up` stack on the CPU, joined by a bridge in a namespace of its own to an edge namespace that runs
the real Envoy (gateway/epp/envoy_config.py; one fail-open, one fail-closed) with our EPP in front. The official
Anthropic and OpenAI SDKs call Envoy from inside the edge namespace (tests/fleet/fleet_client.py); which node
served a request is what that node's gateway logged.

Checked, in this order (the file shares one fleet; the last test kills a node):
- the EPP never started: fail-open Envoy spreads requests round robin over the nodes and none fails; fail-closed
  Envoy answers 503 at once;
- every turn of a session after its first reads >= 95% of the previous turn's prompt from cache, on one node;
- new sessions spread over both nodes;
- a node flooded with cold prefill gets no new session;
- the EPP SIGKILLed: fail-open Envoy goes on round robin and fail-closed answers 503, quickly, nothing hangs;
- a node SIGKILLed mid-load (every process of its namespace): its sessions go on on the other node (cold there,
  warm from the next turn) and no request started after the EPP saw the node gone fails. A turn in flight on the
  node when it dies fails at the transport (its connection is reset; nodes do not hand streams to each other), and
  so may a turn the EPP sent there in the moment before it saw the node gone (within refresh_secs): those are
  counted and printed, not failed on.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fleet_envoy import access_log_entries
from fleet_stack import EPP_METRICS_PORT, RANK_METRICS_PORT, Fleet, fleet

from gateway.epp.envoy_config import FAIL_CLOSED_STATUS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NODES = ["node-a", "node-b"]
CACHE_FRACTION = 0.95  # of the previous turn's prompt, read from cache by every turn after a session's first
HUNG_EPP_S = 15.0  # Envoy's pings to the EPP: 1 s apart, 2 s for an answer; then the stream fails
QUICK_S = 5.0  # an answer Envoy or the EPP gives itself (a refusal, a failure) takes no longer
SYSTEM_WORDS = 250  # ~280 tokens: a cold turn takes ~1 s of a CPU core, a warm one ~0.5 s
VOCABULARY = (
    "cache block prefix token session node rank router gateway envoy picker memory host device stream request "
    "answer model layer tensor kernel queue batch prefill decode turn agent tool file patch test build commit "
    "branch merge review change line function class module package import return value error retry timeout "
    "network bridge namespace address port socket packet route table index hash chain event publisher replay "
    "metric gauge counter histogram latency throughput budget limit window context prompt system user assistant"
)
WORDS = VOCABULARY.split()


def text(seed: str, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def the_fleet(fleet_machine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    started = time.monotonic()
    with fleet(tmp_path_factory.mktemp("fleet"), NODES) as running:
        print(f"fleet of {len(NODES)} nodes up in {time.monotonic() - started:.1f} s")
        yield running


@pytest.fixture
def epp(the_fleet: Fleet) -> Fleet:
    """The fleet with its EPP running and seen SERVING by both Envoys."""
    if the_fleet.epp is None or the_fleet.epp.poll() is not None:
        started = time.monotonic()
        the_fleet.start_epp()
        print(f"EPP serving in {time.monotonic() - started:.1f} s")
    return the_fleet


@dataclass
class Session:
    """A conversation: a long system prompt of its own, then a short user message a turn."""

    name: str
    api: str = "anthropic"
    stream: bool = False
    max_retries: int = 0  # the SDK's own retries (its default is 2)
    messages: list[dict[str, str]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)  # the successful turns, in order
    nodes: list[str] = field(default_factory=list)  # the node of each successful turn

    @property
    def system(self) -> str:
        return text(self.name, SYSTEM_WORDS)

    def next_turn(self) -> list[dict[str, str]]:
        return [
            *self.messages,
            {
                "role": "user",
                "content": f"Turn {len(self.answers) + 1}: {text(self.name + str(len(self.answers)), 30)}",
            },
        ]

    def run_turn(self, the_fleet: Fleet, mode: str = "open") -> dict[str, Any]:
        """One turn through Envoy; a successful one is recorded (its node from the gateway logs) and extends the
        conversation, a failed one is returned for the caller to count and may be sent again."""
        messages = self.next_turn()
        answer = the_fleet.request(
            self.name,
            messages,
            mode=mode,
            api=self.api,
            system=self.system,
            stream=self.stream,
            max_tokens=4,
            max_retries=self.max_retries,
        ).result(timeout=600)
        if answer["ok"]:
            self.answers.append(answer)
            self.nodes.append(the_fleet.served_by(answer["id"]))
            self.messages = [*messages, {"role": "assistant", "content": answer["text"] or "ok"}]
        return answer


def prompt_tokens(answer: dict[str, Any]) -> int:
    usage = answer["usage"]
    if "prompt_tokens" in usage:  # OpenAI
        return int(usage["prompt_tokens"])
    cache = (usage.get("cache_read_input_tokens") or 0) + (usage.get("cache_creation_input_tokens") or 0)
    return int(usage["input_tokens"] + cache)


def cached_tokens(answer: dict[str, Any]) -> int:
    usage = answer["usage"]
    if "prompt_tokens" in usage:
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return int(usage.get("cache_read_input_tokens") or 0)


def assert_warm(session: Session, turn: int) -> None:
    """Turn `turn` (0-based) read >= CACHE_FRACTION of the previous turn's prompt from cache."""
    previous, answer = session.answers[turn - 1], session.answers[turn]
    assert cached_tokens(answer) >= CACHE_FRACTION * prompt_tokens(previous), (
        f"{session.name} turn {turn + 1} on {session.nodes[turn]}: {cached_tokens(answer)} cached of the previous "
        f"{prompt_tokens(previous)} prompt tokens ({session.nodes})"
    )


def run_sessions(the_fleet: Fleet, sessions: list[Session], turns: int, mode: str = "open") -> None:
    """`turns` turns of every session, the sessions at once, each session's turns one after another; every turn
    must succeed."""
    failures: list[str] = []

    def run(session: Session) -> None:
        for _ in range(turns):
            answer = session.run_turn(the_fleet, mode)
            if not answer["ok"]:
                failures.append(f"{session.name}: {answer}")
                return

    threads = [threading.Thread(target=run, args=(session,)) for session in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


def new_requests(the_fleet: Fleet, mode: str, since: int, count: int) -> list[dict[str, Any]]:
    """The access log lines of Envoy `mode` after the first `since`, once there are `count` of them (Envoy writes
    a line once the answer is out, and flushes every 100 ms)."""
    deadline = time.monotonic() + 10
    while True:
        entries = access_log_entries(the_fleet.envoys[mode].access_log)[since:]
        if len(entries) >= count or time.monotonic() > deadline:
            return entries
        time.sleep(0.05)


def access_log_length(the_fleet: Fleet, mode: str) -> int:
    path = the_fleet.envoys[mode].access_log
    return len(access_log_entries(path)) if path.exists() else 0


# --- no EPP: the fail modes ---


def test_without_the_epp_fail_open_goes_round_robin_and_nothing_fails(the_fleet: Fleet) -> None:
    assert the_fleet.epp is None
    the_fleet.wait_epp_health(healthy=False)
    before = access_log_length(the_fleet, "open")
    sessions = [
        Session("rr-0"),
        Session("rr-1", stream=True),
        Session("rr-2", api="openai"),
        Session("rr-3", api="openai", stream=True),
    ]
    run_sessions(the_fleet, sessions, turns=2)
    served = [node for session in sessions for node in session.nodes]
    assert set(served) == set(NODES), served  # round robin: both nodes, whatever the session
    entries = new_requests(the_fleet, "open", before, count=8)
    assert len(entries) == 8 and {entry["cluster"] for entry in entries} == {"nodes"}, entries


def test_without_the_epp_fail_closed_answers_503_at_once(the_fleet: Fleet) -> None:
    assert the_fleet.epp is None
    for session in (Session("closed-0"), Session("closed-1", api="openai"), Session("closed-2", stream=True)):
        answer = session.run_turn(the_fleet, mode="closed")
        assert not answer["ok"] and answer["status"] == FAIL_CLOSED_STATUS, answer
        assert answer["elapsed_s"] < QUICK_S, answer


# --- the EPP ---


def test_each_session_sticks_to_one_node_and_reads_its_prompt_from_cache(epp: Fleet) -> None:
    sessions = [
        Session("sticky-0"),
        Session("sticky-1", stream=True),
        Session("sticky-2", api="openai"),
        Session("sticky-3", api="openai", stream=True),
    ]
    since = epp.epp_log_size()
    run_sessions(epp, sessions, turns=4)
    decisions = epp.epp_decisions(since)
    for session in sessions:
        assert len(set(session.nodes)) == 1, f"{session.name} moved: {session.nodes}"
        for turn in range(1, len(session.answers)):
            assert_warm(session, turn)
        chosen = [(d["node"], d["reason"]) for d in decisions if d.get("session") == session.name]
        assert chosen[1:] == [(session.nodes[0], "session")] * 3, chosen  # the EPP's own account agrees
    print({session.name: session.nodes[0] for session in sessions})


def test_new_sessions_spread_across_nodes(epp: Fleet) -> None:
    sessions = [Session(f"spread-{n}", api=("anthropic", "openai")[n % 2]) for n in range(6)]
    run_sessions(epp, sessions, turns=1)
    served = [session.nodes[0] for session in sessions]
    print("new sessions per node:", {node: served.count(node) for node in NODES})
    assert all(served.count(node) >= 2 for node in NODES), served


def scraped(the_fleet: Fleet, url: str, series: str) -> float:
    """The value of the first sample of `series` (its name, labels included) on a /metrics page; 0 when absent."""
    answer = the_fleet.client.call("http", url=url)
    assert answer["ok"], answer
    for line in answer["text"].splitlines():
        if line.startswith(series):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def rank_waiting_prefill(the_fleet: Fleet, node: str) -> float:
    url = f"http://{the_fleet.node(node).address}:{RANK_METRICS_PORT}/metrics"
    return scraped(the_fleet, url, "kvserve:waiting_prefill_tokens")


def epp_queued_prefill(the_fleet: Fleet, node: str) -> float:
    """The queued prefill the EPP last read for the node: what it places sessions by."""
    url = f"http://{the_fleet.edge.address}:{EPP_METRICS_PORT}/metrics"
    return scraped(the_fleet, url, f'kvserve:epp_node_queued_prefill_tokens{{node="{node}"}}')


def test_an_overloaded_node_gets_no_new_sessions(epp: Fleet) -> None:
    busy, other = NODES
    flood_url = epp.node(busy).url  # straight to the node's gateway, past Envoy: load the EPP did not send
    flood = [
        epp.client.submit(
            "anthropic",
            base_url=flood_url,
            api_key=epp.api_key,
            session=f"flood-{n}",
            system=text(f"flood-{n}", 800),
            messages=[{"role": "user", "content": "Summarise."}],
            max_tokens=1,
        )
        for n in range(8)  # a backlog well above the three fresh sessions' prompts while they are placed
    ]
    deadline = time.monotonic() + 60
    while rank_waiting_prefill(epp, busy) < 4000:
        assert time.monotonic() < deadline, "the flood never queued on the rank"
        time.sleep(0.1)
    # and the EPP has read it (it polls every 0.25 s, later on a loaded machine: a CI run once placed the first
    # fresh session on the flooded node while the EPP's view was older than the flood)
    while epp_queued_prefill(epp, busy) < 4000:
        assert time.monotonic() < deadline, "the EPP never saw the flood"
        time.sleep(0.1)
    sessions = [Session(f"fresh-{n}") for n in range(3)]
    run_sessions(epp, sessions, turns=1)
    assert [session.nodes[0] for session in sessions] == [other] * len(sessions)
    answers = [future.result(timeout=600) for future in flood]
    assert all(answer["ok"] for answer in answers), [answer for answer in answers if not answer["ok"]]


def test_with_the_epp_killed_envoy_fails_open_or_closed_as_configured(epp: Fleet) -> None:
    session = Session("epp-killed")
    assert session.run_turn(epp)["ok"]
    assert session.run_turn(epp, mode="closed")["ok"]
    epp.kill_epp()
    # Racing Envoy's finding the EPP gone: an answer either way, at once (a fail-open request whose body had
    # begun to go to the EPP fails: Envoy keeps no copy of a FULL_DUPLEX_STREAMED body)
    for mode in ("open", "closed"):
        answer = Session(f"epp-racing-{mode}").run_turn(epp, mode)
        assert answer["ok"] or answer["status"] == FAIL_CLOSED_STATUS, answer
        assert answer["ok"] or answer["elapsed_s"] < QUICK_S, answer
        print(
            f"fail-{mode} Envoy, a request as the EPP died: {answer.get('status') or 200}, {answer['elapsed_s']:.2f} s"
        )
    epp.wait_epp_health(healthy=False, timeout_s=10)
    before = access_log_length(epp, "open")
    opened = [Session(f"epp-gone-{n}", api=("anthropic", "openai")[n % 2]) for n in range(4)]
    run_sessions(epp, opened, turns=1)
    assert {session.nodes[0] for session in opened} == set(NODES)  # round robin
    assert {entry["cluster"] for entry in new_requests(epp, "open", before, count=len(opened))} == {"nodes"}
    for n in range(2):
        answer = Session(f"epp-gone-closed-{n}").run_turn(epp, mode="closed")
        assert not answer["ok"] and answer["status"] == FAIL_CLOSED_STATUS, answer
        assert answer["elapsed_s"] < QUICK_S, answer
    epp.start_epp()  # the tests after this one route through it again
    assert session.run_turn(epp)["ok"]


def test_with_the_epp_hung_nothing_hangs_and_it_is_used_again_once_it_answers(epp: Fleet) -> None:
    session = Session("epp-hung")
    assert session.run_turn(epp)["ok"]
    epp.hang_epp(True)
    try:
        # A request as it hangs: Envoy's pings on its connection to the EPP go unanswered and it closes it (then
        # fails open or closed), or its health checks have already seen the EPP silent: answered, never held
        for mode in ("open", "closed"):
            answer = Session(f"epp-hanging-{mode}").run_turn(epp, mode)
            assert answer["ok"] or answer["status"] == FAIL_CLOSED_STATUS, answer
            assert answer["elapsed_s"] < HUNG_EPP_S, answer
            status = answer.get("status") or 200
            print(f"fail-{mode} Envoy, a request as the EPP hung: {status}, {answer['elapsed_s']:.2f} s")
        epp.wait_epp_health(healthy=False, timeout_s=30)
        before = access_log_length(epp, "open")
        opened = [Session(f"epp-hung-{n}", api=("anthropic", "openai")[n % 2]) for n in range(2)]
        run_sessions(epp, opened, turns=1)
        assert {entry["cluster"] for entry in new_requests(epp, "open", before, count=len(opened))} == {"nodes"}
        answer = Session("epp-hung-closed").run_turn(epp, mode="closed")
        assert not answer["ok"] and answer["status"] == FAIL_CLOSED_STATUS and answer["elapsed_s"] < QUICK_S, answer
    finally:
        epp.hang_epp(False)
    epp.wait_epp_health(healthy=True, timeout_s=60)
    before = access_log_length(epp, "open")
    assert session.run_turn(epp)["ok"] and session.run_turn(epp, mode="closed")["ok"]
    assert new_requests(epp, "open", before, count=1)[0]["cluster"] == "epp_destination"


def test_a_node_killed_mid_load_its_sessions_go_on_elsewhere(epp: Fleet) -> None:
    # The clients as users run them: the SDKs' default retries (2). A request whose node died before it was answered
    # is answered by Envoy with 503 (its destination is gone) or cut; the SDK sends it again, and the EPP, which
    # has seen the node go by then, sends it to the other node. Only a stream cut after its first bytes cannot be
    # sent again by the SDK.
    sessions = [
        Session(f"load-{n}", api=("anthropic", "openai")[n % 2], stream=n >= 2, max_retries=2) for n in range(4)
    ]
    run_sessions(epp, sessions, turns=1)
    on_node = {node: [s for s in sessions if s.nodes[0] == node] for node in NODES}
    victim = max(NODES, key=lambda node: len(on_node[node]))
    survivor = next(node for node in NODES if node != victim)
    outcomes: list[tuple[str, dict[str, Any]]] = []  # (session, answer) of every turn after the first
    stop = threading.Event()
    seen_down = threading.Event()
    after_seen: dict[str, int] = {session.name: 0 for session in sessions}  # turns started after seen_down

    def load(session: Session) -> None:
        while not stop.is_set():
            counted = seen_down.is_set()
            answer = session.run_turn(epp)
            outcomes.append((session.name, answer))
            if counted:
                after_seen[session.name] += 1
                if after_seen[session.name] >= 2:
                    return

    threads = [threading.Thread(target=load, args=(session,)) for session in sessions]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 120
        while len(outcomes) < 2 * len(sessions):  # mid-load: every session on its way, turns in flight
            assert time.monotonic() < deadline, outcomes
            time.sleep(0.05)
        log_size = epp.epp_log_size()
        killed_at = time.time()
        epp.node(victim).kill()
        epp.wait_epp_log(f"node {victim} is not ready", since=log_size, timeout_s=30)
        seen_at = time.time()
        seen_down.set()
        for thread in threads:
            thread.join(timeout=300)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
    failed = [(name, answer) for name, answer in outcomes if not answer["ok"]]
    in_flight = [(name, answer) for name, answer in failed if answer["started_at"] < killed_at]
    in_window = [(name, answer) for name, answer in failed if killed_at <= answer["started_at"] < seen_at]
    print(
        f"killed {victim}; the EPP logged it not ready {seen_at - killed_at:.2f} s later; {len(outcomes)} turns under "
        f"load; failed: {len(in_flight)} in flight on {victim} when it died, {len(in_window)} started before the EPP "
        f"saw it: {[(name, answer.get('status'), answer.get('error')) for name, answer in in_flight + in_window]}"
    )
    late = [(name, answer) for name, answer in failed if answer["started_at"] >= seen_at]
    assert not late, late
    streamed = {session.name for session in sessions if session.stream}
    assert all(name in streamed for name, _ in failed), failed  # no request that could be sent again failed
    assert all(count >= 2 for count in after_seen.values()), after_seen
    for session in on_node[victim]:
        moved = [turn for turn, node in enumerate(session.nodes) if node == survivor]
        assert moved and session.nodes[moved[0] :] == [survivor] * (len(session.nodes) - moved[0]), session.nodes
        for turn in moved[1:]:  # cold on the survivor at first, warm from the next turn
            assert_warm(session, turn)
    for session in on_node[survivor]:
        assert set(session.nodes) == {survivor}, session.nodes
