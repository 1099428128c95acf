"""What each failure does, with the whole stack as real processes: a rank SIGKILLed under load, the router
killed and restarted, the kvstore restarted, Redis restarted."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from service_processes import redis_client
from whole_stack import (
    Stack,
    cached_tokens_metric,
    chat_turn,
    evict_l0,
    finished_per_rank,
    served_by,
    stream_message,
    touch_ranks,
    whole_stack,
)

# A small L0 pool so sessions get evicted to L1; prefill in small chunks so a kill lands mid-request.
RANK_SETTINGS = {
    "KVSERVE_NUM_KV_BLOCKS": "128",
    "KVSERVE_MAX_MODEL_LEN": "2048",
    "KVSERVE_MAX_NUM_BATCHED_TOKENS": "128",
}


def context(name: str, words: int = 300) -> str:
    return f"Session {name}. Notes: " + " ".join(f"{name}{i % 29} entry {i}" for i in range(words // 3))


GATEWAY_SETTINGS = {"KVSERVE_PING_INTERVAL_SECS": "0.5"}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """A fresh stack, for the test that kills a rank for good."""
    with whole_stack(tmp_path, ranks=2, rank_settings=RANK_SETTINGS, gateway_settings=GATEWAY_SETTINGS) as s:
        yield s


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("service-failures")
    with whole_stack(tmp, ranks=2, rank_settings=RANK_SETTINGS, gateway_settings=GATEWAY_SETTINGS) as s:
        yield s


@pytest.fixture
def restarted_stack(shared_stack: Stack) -> Stack:
    """One stack (a start is ~60 s) for the tests that restart what they kill (router, kvstore, Redis): each
    finds every service up; one a failed test left down is started again here, on its port."""
    dead = [service for service in shared_stack.services.values() if not service.alive()]
    for service in dead:
        service.start()
    if dead:
        shared_stack.wait_ranks_healthy(len(shared_stack.rank_names()))
    return shared_stack


def stream_story(url: str, session: str, on_delta=None, max_tokens: int = 80) -> tuple[list[str], str]:
    """A greedy streamed reply; `on_delta(count)` runs after each text delta. Returns event names and text."""
    body = {
        "model": "default",
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Write a long story about {session}."}],
    }
    headers = {"x-claude-code-session-id": session}
    names, text, _ = stream_message(url, body, headers=headers, on_delta=on_delta, timeout_s=300)
    return names, text


def test_rank_killed_under_load(stack: Stack) -> None:
    # a session with history on some rank, and the uninterrupted text of a story, for reference
    history = [{"role": "user", "content": context("resume")}]
    before = finished_per_rank(stack)
    reply, _ = chat_turn(stack.url, "resume", history)
    home = served_by(before, finished_per_rank(stack))[0]
    history += [{"role": "assistant", "content": reply or "ok"}, {"role": "user", "content": "Continue."}]
    _, reference = stream_story(stack.url, "resume")  # same session: served by `home` too

    # load: several requests at once, on both ranks; kill `home` once streams are flowing
    killed = threading.Event()

    def kill_home(count: int) -> None:
        if count == 3 and not killed.is_set():
            killed.set()
            os.kill(stack[home].process.pid, signal.SIGKILL)

    def short(i: int) -> str:
        return chat_turn(stack.url, f"load-{i}", [{"role": "user", "content": context(f"l{i}", 120)}], 4)[0]

    with ThreadPoolExecutor(8) as pool:
        shorts = [pool.submit(short, i) for i in range(6)]
        story = pool.submit(stream_story, stack.url, "resume", kill_home)
        names, text = story.result(timeout=300)
        results = [f.result(timeout=300) for f in shorts]  # chat_turn asserts 200 for each
    assert killed.is_set() and len(results) == 6
    # the story was cut mid-way and went on on the survivor: it reads exactly like the uninterrupted run
    assert names[-1] == "message_stop" and "error" not in names
    assert text == reference

    survivor = next(r for r in stack.rank_names() if r != home)
    stack.wait_until(
        "the router marking the killed rank down",
        lambda: all(r.healthy == (r.rank_id == survivor) for r in stack.router_ranks().ranks),
        timeout_s=30,
    )
    # new requests go to the survivor; the dead rank's session continues there, from L1
    before = finished_per_rank(stack)
    l1_before = cached_tokens_metric(stack.url).get("l1", 0.0)
    _, usage = chat_turn(stack.url, "resume", history)
    assert served_by(before, finished_per_rank(stack)) == [survivor]
    assert cached_tokens_metric(stack.url)["l1"] - l1_before > 0, usage


def test_router_killed_and_restarted(restarted_stack: Stack) -> None:
    stack = restarted_stack
    sessions = ["s-a", "s-b", "s-c", "s-d"]
    homes: dict[str, str] = {}
    for session in sessions:
        before = finished_per_rank(stack)
        chat_turn(stack.url, session, [{"role": "user", "content": context(session, 90)}], 2)
        homes[session] = served_by(before, finished_per_rank(stack))[0]
    assert len(set(homes.values())) == 2  # new sessions spread over both ranks

    # a stream in flight while the router dies: the data plane does not go through the router
    def kill_router(count: int) -> None:
        if count == 2:
            stack["router"].kill()

    names, text = stream_story(stack.url, "in-flight", kill_router)
    assert names[-1] == "message_stop" and "error" not in names and text
    assert not stack["router"].alive()
    # while it is away, requests are still served
    chat_turn(stack.url, "s-a", [{"role": "user", "content": context("s-a", 90)}], 2)

    stack["router"].start()
    stack.wait_ranks_healthy(2)
    for session in sessions:  # sticky across the restart: state came back from Redis
        before = finished_per_rank(stack)
        chat_turn(stack.url, session, [{"role": "user", "content": context(session, 90) + " More."}], 2)
        assert served_by(before, finished_per_rank(stack)) == [homes[session]], session


def test_kvstore_restart_serves_l0_only_then_l1_again(restarted_stack: Stack) -> None:
    stack = restarted_stack
    stack["kvstore"].kill()
    # L0 only: requests still succeed
    for i in range(3):
        chat_turn(stack.url, f"k{i}", [{"role": "user", "content": context(f"k{i}", 60)}], 2)
    stack["kvstore"].start()

    # a rank notices the new arena on its next use of L1: traffic until both have attached and written to it
    def l1_back() -> bool:
        touch_ranks(stack)
        return stack.kvstore_stats().stored_slots > 0 and all(
            stack.rank_stats(r).l1_attached for r in stack.rank_names()
        )

    stack.wait_until("ranks re-attached to the new arena and writing to it", l1_back, timeout_s=90)
    # and L1 is used again: a session evicted from L0 comes back from the new arena
    history = [{"role": "user", "content": context("again")}]
    reply, _ = chat_turn(stack.url, "again", history)
    history += [{"role": "assistant", "content": reply or "ok"}, {"role": "user", "content": "More."}]
    evict_l0(stack, seed=3)
    l1_before = cached_tokens_metric(stack.url).get("l1", 0.0)
    _, usage = chat_turn(stack.url, "again", history)
    assert cached_tokens_metric(stack.url)["l1"] - l1_before > 0, usage


def test_redis_restart_router_survives_and_resyncs(restarted_stack: Stack) -> None:
    stack = restarted_stack
    client = redis_client(stack["redis"].port, socket_timeout=5)
    chat_turn(stack.url, "before-outage", [{"role": "user", "content": "hello"}], 2)
    assert client.exists("kvserve:session:before-outage")

    stack["redis"].kill()
    # the router keeps routing from memory
    for i in range(3):
        chat_turn(stack.url, f"during-outage-{i}", [{"role": "user", "content": f"hi {i}"}], 2)
    assert stack.router_ranks().redis_connected is False

    client.connection_pool.disconnect()
    stack["redis"].start()  # same port, same append-only dir
    stack.wait_until("the router reconnected to Redis", lambda: stack.router_ranks().redis_connected, timeout_s=60)
    # resynced: what was routed during the outage is in Redis now
    stack.wait_until(
        "outage sessions written back",
        lambda: all(client.exists(f"kvserve:session:during-outage-{i}") for i in range(3)),
        timeout_s=30,
    )
    assert client.exists("kvserve:session:before-outage")
