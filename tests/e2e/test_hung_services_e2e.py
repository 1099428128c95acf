"""Faults that are not crashes, as they happen, through the whole stack (real processes, two ranks): a rank
SIGSTOPped under a stream or before a request, a router SIGSTOPped, one request's bad sampling parameter or
its own deadline, session ids the router would refuse. Each one's failure must stay its own: innocent streams
finish, healthy ranks stay in routing, and a hung service costs seconds once, not per request."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from service_processes import free_port, running_process, wait_http_ready
from whole_stack import Stack, finished_per_rank, served_by, stream_message, whole_stack

from contracts.config import DEFAULTS

STALL_S = 3.0  # the gateway's rank_stall_secs here: a few seconds without a token or progress = hung
ROUTER_TIMEOUT_S = 2.0  # gateway/ranks/rank_choice.ROUTE_TIMEOUT_S
STORY = [{"role": "user", "content": "Write a long story about a cache."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The router and the ranks heartbeat at the defaults: what an operator gets is what is measured.
    beats = {"KVSERVE_HEARTBEAT_INTERVAL_SECS": str(DEFAULTS.heartbeat_interval_secs)}
    router = {**beats, "KVSERVE_RANK_DOWN_AFTER_SECS": str(DEFAULTS.rank_down_after_secs)}
    ranks = {**beats, "KVSERVE_NUM_KV_BLOCKS": "256", "KVSERVE_MAX_MODEL_LEN": "2048"}
    gateway = {"KVSERVE_RANK_STALL_SECS": str(STALL_S), "KVSERVE_PING_INTERVAL_SECS": "0.5"}
    with whole_stack(tmp_path_factory.mktemp("hung"), 2, ranks, gateway, router) as running:
        yield running


def _settled(stack: Stack) -> None:
    """Both ranks healthy and idle: a resumed rank has dealt with the requests cancelled while it was stopped."""
    stack.wait_ranks_healthy(2)
    stack.wait_until(
        "ranks idle", lambda: all(not (s.running or s.waiting) for s in map(stack.rank_stats, stack.rank_names()))
    )


@pytest.fixture(autouse=True)
def healthy_again(stack: Stack) -> Iterator[None]:
    _settled(stack)
    yield
    for service in stack.services.values():  # a failed test must not leave a stopped process behind
        if service.alive():
            os.kill(service.process.pid, signal.SIGCONT)  # type: ignore[union-attr]
    _settled(stack)


def _health(stack: Stack) -> dict[str, bool]:
    return {rank.rank_id: rank.healthy for rank in stack.router_ranks().ranks}


def _post(url: str, body: dict, session: str = "", timeout_s: float = 120) -> httpx.Response:
    headers = {"x-claude-code-session-id": session} if session else {}
    return httpx.post(f"{url}/v1/messages", json={"model": "default", **body}, headers=headers, timeout=timeout_s)


def _stream(url: str, body: dict, on_delta=None, timeout_s: float = 120) -> tuple[list[str], str, dict]:  # type: ignore[no-untyped-def]
    return stream_message(url, {"model": "default", "stream": True, **body}, on_delta=on_delta, timeout_s=timeout_s)


def _serving_rank(stack: Stack) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for name in stack.rank_names():
            stats = stack.rank_stats(name)
            if stats.running or stats.waiting:
                return name
        time.sleep(0.02)
    raise TimeoutError("no rank picked up the request")


def _stop(stack: Stack, name: str) -> None:
    os.kill(stack[name].process.pid, signal.SIGSTOP)  # type: ignore[union-attr]


def _resume(stack: Stack, name: str) -> None:
    os.kill(stack[name].process.pid, signal.SIGCONT)  # type: ignore[union-attr]


# --- point 1: one request's bad sampling parameter ---


def test_a_tiny_temperature_cuts_no_other_stream_and_no_rank(stack: Stack) -> None:
    """temperature 1e-40 overflowed logits / temperature: the rank failed every request of the step, and the
    gateway retried it on the other rank, which failed too."""
    greedy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    results: dict[str, httpx.Response] = {}

    def send(key: str, body: dict) -> None:
        results[key] = _post(stack.url, body)

    threads = [
        threading.Thread(
            target=send, args=(f"greedy-{i}", {**greedy, "messages": [{"role": "user", "content": f"Count {i}."}]})
        )
        for i in range(6)
    ]
    tiny = {"max_tokens": 24, "temperature": 1e-40, "ignore_eos": True, "messages": STORY}
    threads.append(threading.Thread(target=send, args=("tiny", tiny)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    statuses = {key: response.status_code for key, response in results.items()}
    assert set(statuses.values()) == {200}, {key: r.text[:200] for key, r in results.items() if r.status_code != 200}
    assert all(results[key].json()["usage"]["output_tokens"] == 24 for key in results)
    # treated as greedy: the same text as temperature 0
    assert results["tiny"].json()["content"] == _post(stack.url, {**greedy, "messages": STORY}).json()["content"]
    assert all(_health(stack).values())


# --- point 2: the request's own deadline is not the rank's failure ---


def test_a_requests_own_deadline_keeps_the_rank_in_routing(stack: Stack, tmp_path: Path) -> None:
    port = free_port()
    env = {**stack["gateway"].env, "KVSERVE_REQUEST_TIMEOUT_SECS": "2"}
    args = [*stack["gateway"].args[:-1], str(port)]  # the stack's gateway command on another port
    with running_process(
        args, env, tmp_path / "gateway.log", lambda p: wait_http_ready(f"http://127.0.0.1:{port}/ready", p)
    ):
        before = finished_per_rank(stack)
        seen_down: list[dict[str, bool]] = []
        stop_watching = threading.Event()

        def watch() -> None:  # a rank marked down is back at its next heartbeat: look all the time
            while not stop_watching.is_set():
                health = _health(stack)
                if not all(health.values()):
                    seen_down.append(health)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        router_log_start = stack.log_size("router")
        try:
            body = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True, "messages": STORY}
            names, _, last = _stream(f"http://127.0.0.1:{port}", body)
            stack.wait_until(
                "the rank done with the request",
                lambda: all(not (s.running or s.waiting) for s in map(stack.rank_stats, stack.rank_names())),
            )
            after = finished_per_rank(stack)
            # A marker through the same gateway: its route goes to the router on the channel a failure report
            # would have taken, after it. Once the router has routed the marker, such a report has been handled.
            marker = f"deadline-marker-{time.monotonic_ns()}"
            hi = {"max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "Hi."}]}
            assert _post(f"http://127.0.0.1:{port}", hi, marker).status_code == 200
            stack.route_fields(marker, router_log_start)
        finally:
            stop_watching.set()
            watcher.join()
        assert names[-1] == "error" and last["error"]["type"] == "api_error"
        assert seen_down == [], "the gateway's own deadline marked a healthy rank down"
        router_log = stack["router"].log_path.read_bytes()[router_log_start:].decode(errors="replace")
        assert " marked down: " not in router_log, "the gateway's own deadline reported a healthy rank failed"
        assert len(served_by(before, after)) == 1, "the request was retried on the other rank"


# --- point 3: a hung rank ---


def test_a_stream_on_a_hung_rank_continues_on_the_other(stack: Stack) -> None:
    body = {"max_tokens": 80, "temperature": 0, "messages": STORY}
    _, reference, reference_end = _stream(stack.url, body)
    stopped: list[str] = []
    stopped_at: list[float] = []

    def stop_after_three(count: int) -> None:
        if count == 3:
            stopped.append(_serving_rank(stack))
            _stop(stack, stopped[0])
            stopped_at.append(time.monotonic())

    try:
        names, text, end = _stream(stack.url, body, on_delta=stop_after_three)
        finished_at = time.monotonic()
        assert names[-1] == "message_stop" and "error" not in names, end
        assert text == reference  # prompt + tokens sent went on on the other rank: nothing lost or repeated
        assert end["usage"]["output_tokens"] == reference_end["usage"]["output_tokens"]
        assert finished_at - stopped_at[0] < 30  # before: the stream sat on the stopped rank with pings only
        assert _health(stack)[stopped[0]] is False  # reported to the router: no new request goes there
    finally:
        if stopped:
            _resume(stack, stopped[0])


def test_a_request_sent_to_a_hung_rank_does_not_wait_for_it(stack: Stack) -> None:
    session = "hung-rank-sticky"
    messages = [{"role": "user", "content": "Name a colour."}]
    before = finished_per_rank(stack)
    assert _post(stack.url, {"max_tokens": 4, "temperature": 0, "messages": messages}, session).status_code == 200
    (home,) = served_by(before, finished_per_rank(stack))
    _stop(stack, home)  # the router still routes the session here until the heartbeats are missed
    try:
        started = time.monotonic()
        again = _post(stack.url, {"max_tokens": 4, "temperature": 0, "messages": messages}, session, timeout_s=40)
        assert again.status_code == 200, again.text
        # one acceptance wait (rank_stall_secs), not the request deadline
        assert time.monotonic() - started < STALL_S + 10
    finally:
        _resume(stack, home)


def test_the_router_stops_routing_to_a_rank_without_heartbeats_within_seconds(stack: Stack) -> None:
    name = stack.rank_names()[1]
    age = next(r.last_heartbeat_age_s for r in stack.router_ranks().ranks if r.rank_id == name)
    last_arrival = time.monotonic() - age  # measured from the heartbeat the router last received
    _stop(stack, name)
    try:
        stack.wait_until(f"{name} down at the router", lambda: _health(stack)[name] is False, timeout_s=20)
        down_after = time.monotonic() - last_arrival
    finally:
        _resume(stack, name)
    # rank_down_after_secs was 5 s (down 5-6 s after the last heartbeat); now 3 missed heartbeats
    assert down_after < 5.0, f"marked down {down_after:.1f} s after its last heartbeat"


# --- point 4: a hung router ---


def test_a_hung_router_costs_one_timeout_then_routing_falls_back_at_once(stack: Stack) -> None:
    body = {"max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi."}]}
    _stop(stack, "router")
    try:
        took = []
        for i in range(4):
            started = time.monotonic()
            assert _post(stack.url, body, f"router-hung-{i}").status_code == 200
            took.append(time.monotonic() - started)
    finally:
        _resume(stack, "router")
    # the first request waits for the route timeout; later ones route by the fallback without asking
    assert max(took[1:]) < ROUTER_TIMEOUT_S, took
    stack.wait_ranks_healthy(2)  # the router missed heartbeats while stopped

    def routed_by_the_router_again() -> bool:
        sessions = stack.router_ranks().sessions
        assert _post(stack.url, body, f"router-back-{time.monotonic()}").status_code == 200
        return stack.router_ranks().sessions > sessions

    stack.wait_until("the gateway routes through the router again", routed_by_the_router_again, timeout_s=30)


# --- point 9: session ids the router would refuse ---


def test_long_and_unprintable_session_ids_route_and_stick(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
    sessions_before = stack.router_ranks().sessions
    log_start = stack["gateway"].log_path.stat().st_size
    for session in ("s" * 300, "tab\there\x01bell\x07"):
        homes = []
        for turn in range(2):
            before = finished_per_rank(stack)
            client.chat.completions.create(
                model="default",
                max_tokens=2,
                temperature=0,
                user=session,
                messages=[{"role": "user", "content": f"Turn {turn}."}],
            )
            homes.append(served_by(before, finished_per_rank(stack)))
        assert homes[0] == homes[1] and len(homes[0]) == 1, homes  # same session, same rank
    assert stack.router_ranks().sessions == sessions_before + 2  # the router took both sessions
    with stack["gateway"].log_path.open("rb") as log_file:
        log = log_file.read()[log_start:].decode(errors="replace")
    assert "not answering" not in log and "refused to route" not in log  # the router was never taken for down
