"""The whole stack (redis-server, kvstore, router, two rank workers, gateway) routing real sessions:
stickiness and L0 hits, load balance for new sessions, L1 restores of sessions L0 evicted, a new session sent to
the rank whose L0 holds its prefix, and the router's view of L1 (what the kvstore holds counts in the route,
nothing once the kvstore is killed), and the router's per-session view (`kvserve sessions`).
tests/router/test_router_component.py and test_router_l1_component.py check
the router alone, the test standing in for the ranks."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from service_processes import ROOT, service_env
from whole_stack import (
    Stack,
    cached_tokens_metric,
    chat_turn,
    evict_l0,
    finished_per_rank,
    served_by,
    whole_stack,
)

from contracts import internal_auth
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc
from protos import router_pb2, router_pb2_grpc

# A small L0 pool (96 blocks x 16 = 1,536 tokens per rank): a few sessions evict each other.
RANK_SETTINGS = {"KVSERVE_NUM_KV_BLOCKS": "96", "KVSERVE_MAX_MODEL_LEN": "2048"}


def session_context(name: str, words: int = 420) -> str:
    """A long first message unique to one session (no prefix shared with another session)."""
    return f"Session {name}. Notes: " + " ".join(f"{name}{i % 37} item {i}" for i in range(words // 3))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with whole_stack(tmp_path_factory.mktemp("stack"), ranks=2, rank_settings=RANK_SETTINGS, l1_host_gb="0.5") as s:
        yield s


def test_a_session_stays_on_one_rank_and_hits_l0(stack: Stack) -> None:
    messages = [{"role": "user", "content": session_context("alpha")}]
    ranks_used: set[str] = set()
    for turn in range(4):
        before = finished_per_rank(stack)
        reply, usage = chat_turn(stack.url, "alpha", messages)
        ranks_used.update(served_by(before, finished_per_rank(stack)))
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
        if turn > 0:
            assert usage["cache_read_input_tokens"] >= 0.9 * prompt, (turn, usage)
        messages += [{"role": "assistant", "content": reply or "ok"}, {"role": "user", "content": f"Next {turn}."}]
    assert len(ranks_used) == 1, ranks_used


def test_a_new_session_goes_to_the_less_loaded_rank(stack: Stack) -> None:
    # load one rank with long generations (straight to it: ignore_eos keeps them running), then start a
    # new session through the gateway
    busy = stack.rank_names()[0]
    request = pb.GenerateRequest(
        prompt_token_ids=list(range(100, 160)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
    )
    channel = internal_auth.channel(stack[busy].address)
    calls = [pb_grpc.RankWorkerStub(channel).Generate(request, timeout=300) for _ in range(3)]
    try:
        stack.wait_until("the rank running all three", lambda: stack.rank_stats(busy).running == len(calls))
        # the router learns the load from heartbeats (every 0.5 s here)
        stack.wait_until(
            "the router seeing the busy rank's load",
            lambda: any(r.rank_id == busy and r.load.running == len(calls) for r in stack.router_ranks().ranks),
        )
        before = finished_per_rank(stack)
        chat_turn(stack.url, "fresh-session", [{"role": "user", "content": "Say hello."}], max_tokens=2)
        used = served_by(before, finished_per_rank(stack))
        assert stack.rank_stats(busy).running > 0  # still busy when the new session was routed
    finally:
        for call in calls:
            call.cancel()
        channel.close()
    assert used and busy not in used, (busy, used)


def test_an_evicted_session_is_restored_from_l1_with_the_same_output(stack: Stack) -> None:
    messages = [{"role": "user", "content": session_context("bravo")}]
    reply, _ = chat_turn(stack.url, "bravo", messages)
    messages += [{"role": "assistant", "content": reply or "ok"}, {"role": "user", "content": "Go on."}]
    # other work pushes bravo's blocks out of both ranks' small L0 pools (they stay in L1)
    evict_l0(stack, seed=1)
    l1_before = cached_tokens_metric(stack.url).get("l1", 0.0)
    ranks_before = ranks_metrics(stack)
    restored_reply, usage = chat_turn(stack.url, "bravo", messages, max_tokens=16)
    l1_restored = cached_tokens_metric(stack.url)["l1"] - l1_before
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert l1_restored >= 0.5 * prompt, (l1_restored, usage)
    assert usage["cache_read_input_tokens"] >= l1_restored
    # the ranks' own metrics saw the same restore: vLLM's external_kv_transfer source, kvserve's bytes and seconds
    grew = metrics_growth(ranks_before, ranks_metrics(stack))
    assert grew["vllm:prompt_tokens_by_source_total", "external_kv_transfer"] == l1_restored, grew
    assert grew["kvserve:l1_restore_bytes_total", ""] > 0 and grew["kvserve:l1_restore_seconds_total", ""] > 0, grew

    # the same turn cold: neither L0 (evicted again) nor L1 (restarted empty) holds it
    stack["kvstore"].kill()
    stack["kvstore"].start()
    evict_l0(stack, seed=2)
    cold_reply, cold_usage = chat_turn(stack.url, "bravo", messages, max_tokens=16)
    assert cold_usage["cache_read_input_tokens"] < 0.2 * prompt, cold_usage
    assert restored_reply == cold_reply


@contextlib.contextmanager
def kept_busy(stack: Stack, rank: str) -> Iterator[None]:
    """Long generations straight to `rank` (ignore_eos keeps them running) while the block runs, once the
    router sees them as its load; cancelled at the end."""
    request = pb.GenerateRequest(
        prompt_token_ids=list(range(100, 160)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
    )
    with internal_auth.channel(stack[rank].address) as channel:
        calls = [pb_grpc.RankWorkerStub(channel).Generate(request, timeout=300) for _ in range(3)]
        try:
            stack.wait_until(
                f"the router seeing {rank} busy",
                lambda: any(r.rank_id == rank and r.load.running == len(calls) for r in stack.router_ranks().ranks),
            )
            yield
        finally:
            for call in calls:
                call.cancel()


def test_a_new_session_goes_to_the_rank_whose_l0_holds_its_prefix(stack: Stack) -> None:
    """The router's prefix match, end to end: a new session opening with a long prefix that another session
    left in one rank's L0 goes to that rank, with both ranks idle, for each of the two ranks."""
    for home in stack.rank_names():
        other = next(name for name in stack.rank_names() if name != home)
        owner, follower = f"prefix-owner-{home}", f"prefix-follower-{home}"
        context = session_context(owner, 240)
        stack.wait_no_load_at_router()
        since = stack.log_size("router")
        with kept_busy(stack, other):  # so the owner's new session goes to `home`, the less loaded rank
            chat_turn(stack.url, owner, [{"role": "user", "content": context}], max_tokens=2)
        assert stack.route_fields(owner, since)["rank"] == home
        stack.wait_no_load_at_router()  # no load left to steer the follower: only what each rank holds

        since = stack.log_size("router")
        before = finished_per_rank(stack)
        content = context + " Now a different question: what comes next?"
        _, usage = chat_turn(stack.url, follower, [{"role": "user", "content": content}], max_tokens=2)
        route = stack.route_fields(follower, since)
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
        assert route["rank"] == home, (home, route)
        assert int(route["l0"]) >= 0.8 * prompt, (route, usage)  # the router expected the prefix in L0 there
        assert served_by(before, finished_per_rank(stack)) == [home]
        assert usage["cache_read_input_tokens"] >= 0.8 * prompt, usage  # and the rank found it there


def ranks_metrics(stack: Stack) -> dict[tuple[str, str], float]:
    """Every rank's counter samples summed over the ranks: (sample name, source label or "") -> value."""
    totals: dict[tuple[str, str], float] = {}
    for name in stack.rank_names():
        for family in stack.scrape(name).values():
            for sample in family.samples:
                key = (sample.name, sample.labels.get("source", ""))
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def metrics_growth(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def test_every_service_exports_its_metrics(stack: Stack) -> None:
    """/metrics on each rank (vLLM's names, types and labels), the router and the kvstore, moving as a session's
    two turns should: the second hits L0 on the same rank (sticky), and the kvstore holds the first's blocks."""
    router_families = stack.scrape("router")
    decisions_before = {s.labels["reason"]: s.value for s in router_families["kvserve:router_decisions"].samples}
    turns_before = {s.labels["outcome"]: s.value for s in router_families["kvserve:router_session_turns"].samples}
    ranks_before = ranks_metrics(stack)
    messages = [{"role": "user", "content": session_context("metrics", 240)}]
    reply, _ = chat_turn(stack.url, "metrics", messages, max_tokens=2)
    messages += [{"role": "assistant", "content": reply or "ok"}, {"role": "user", "content": "Again."}]
    _, usage = chat_turn(stack.url, "metrics", messages, max_tokens=2)

    vllm_types = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens_by_source": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
    }
    for name in stack.rank_names():
        families = stack.scrape(name)
        for family, kind in vllm_types.items():
            assert families[family].type == kind, (name, family)
            for sample in families[family].samples:
                assert sample.labels["engine"] == name and sample.labels["model_name"], sample
        assert 0.0 <= families["vllm:kv_cache_usage_perc"].samples[0].value <= 1.0
        (info,) = families["vllm:cache_config_info"].samples
        assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "96", info
    grew = metrics_growth(ranks_before, ranks_metrics(stack))
    assert grew["vllm:prefix_cache_hits_total", ""] >= usage["cache_read_input_tokens"] > 0, (grew, usage)
    assert grew["vllm:prompt_tokens_by_source_total", "local_cache_hit"] >= usage["cache_read_input_tokens"], grew
    assert grew["vllm:time_to_first_token_seconds_count", ""] == 2, grew
    assert grew["vllm:e2e_request_latency_seconds_count", ""] == 2, grew

    router_families = stack.scrape("router")
    decisions = {s.labels["reason"]: s.value for s in router_families["kvserve:router_decisions"].samples}
    turns = {s.labels["outcome"]: s.value for s in router_families["kvserve:router_session_turns"].samples}
    assert decisions["session"] - decisions_before["session"] == 1, decisions  # the second turn
    assert sum(decisions.values()) - sum(decisions_before.values()) == 2, decisions
    assert turns["sticky"] - turns_before["sticky"] == 1 and turns["new"] - turns_before["new"] == 1, turns
    assert router_families["kvserve:router_ranks"].type == "gauge"
    stack.wait_until("the router's Redis up", lambda: stack.scrape("router")["kvserve:redis_up"].samples[0].value == 1)

    stack.wait_l1_attached()
    stack.wait_until(
        "the kvstore holding written-through blocks",
        lambda: stack.scrape("kvstore")["kvserve:l1_used_bytes"].samples[0].value > 0,
    )
    kvstore = stack.scrape("kvstore")
    assert kvstore["kvserve:l1_capacity_bytes"].samples[0].value >= kvstore["kvserve:l1_used_bytes"].samples[0].value
    assert kvstore["kvserve:l1_stored_blocks"].type == "counter"


def test_the_router_routes_by_what_l1_holds_and_forgets_it_with_the_kvstore(stack: Stack) -> None:
    """The router's view of L1, end to end: blocks the ranks wrote to the kvstore reach the router's index
    (expected L1 tokens in the route of a prompt no L0 holds any more) and the rank restores them; a killed
    kvstore empties the router's L1, and a prompt that was in it routes with none expected."""
    stack.wait_l1_attached()  # an earlier test may have restarted the kvstore
    contexts = {name: session_context(name, 240) for name in ("l1-alpha", "l1-beta")}
    for name, context in contexts.items():
        chat_turn(stack.url, name, [{"role": "user", "content": context}], max_tokens=2)
    evict_l0(stack, seed=11)  # both contexts out of both L0 pools; they stay in L1
    stack.wait_until(
        "the router's L1 index caught up with the kvstore",
        lambda: (
            all(stack.rank_stats(name).l1_copies_in_flight == 0 for name in stack.rank_names())
            and stack.router_ranks().l1_blocks == stack.kvstore_stats().stored_slots > 0
        ),
    )

    since = stack.log_size("router")
    l1_before = cached_tokens_metric(stack.url).get("l1", 0.0)
    content = contexts["l1-alpha"] + " What comes next?"
    _, usage = chat_turn(stack.url, "l1-alpha-again", [{"role": "user", "content": content}], max_tokens=2)
    route = stack.route_fields("l1-alpha-again", since)
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert int(route["l1"]) >= 0.5 * prompt, (route, usage)
    assert cached_tokens_metric(stack.url)["l1"] - l1_before >= 0.5 * prompt, usage  # restored from L1

    stack["kvstore"].kill()
    try:
        stack.wait_until("the router's L1 emptied", lambda: stack.router_ranks().l1_blocks == 0, timeout_s=30)
        since = stack.log_size("router")
        content = contexts["l1-beta"] + " What comes next?"
        _, usage = chat_turn(stack.url, "l1-beta-again", [{"role": "user", "content": content}], max_tokens=2)
        route = stack.route_fields("l1-beta-again", since)
        assert route["l1"] == "0", route  # in L1 until the kill, in no L0 since the eviction
        assert usage["cache_read_input_tokens"] < 0.5 * (usage["input_tokens"] + usage["cache_read_input_tokens"])
    finally:
        stack["kvstore"].start()
        stack.wait_l1_attached()  # as the other tests expect it


def router_session(stack: Stack, session: str) -> router_pb2.SessionStats | None:
    with internal_auth.channel(stack["router"].address) as channel:
        reply = router_pb2_grpc.RouterStub(channel).ListSessions(router_pb2.ListSessionsRequest(), timeout=10)
    return next((stats for stats in reply.sessions if stats.session_id == session), None)


def test_kvserve_sessions_shows_a_sessions_calls_tokens_and_rank(stack: Stack) -> None:
    """Two turns of one session through the gateway, then `kvserve sessions --json`: the gateway reported both
    (in the background, after each answer) and the router's view counts them: calls, the rank that served
    them, prompt tokens from L0 on the second call, computed = prompt - L0 - L1, one cold prefill (the first)."""
    session = "per-session-view"
    before = finished_per_rank(stack)
    messages = [{"role": "user", "content": session_context("view", 240)}]
    reply, first = chat_turn(stack.url, session, messages, max_tokens=2)
    messages += [{"role": "assistant", "content": reply or "ok"}, {"role": "user", "content": "And then?"}]
    _, second = chat_turn(stack.url, session, messages, max_tokens=2)
    (rank,) = served_by(before, finished_per_rank(stack))
    assert second["cache_read_input_tokens"] > 0, second  # the second turn found its prefix

    # ReportFinished is fire-and-forget after each answer: wait for the router to have counted both
    deadline = time.monotonic() + 30
    while (stats := router_session(stack, session)) is None or stats.calls < 2:
        assert time.monotonic() < deadline, f"the router's view of {session}: {stats}"
        time.sleep(0.1)

    command = [sys.executable, "-m", "launcher.cli", "sessions", "--json", "--limit", "0"]
    result = subprocess.run(
        [*command, "--target", stack["router"].address],
        cwd=ROOT,
        env=service_env(),  # the internal secret of the stack (KVSERVE_INTERNAL_SECRET_FILE), as `kvserve up`'s
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    seen = [entry["last_seen_unix_s"] for entry in document["sessions"]]
    assert seen == sorted(seen, reverse=True)  # newest first
    entry = next(entry for entry in document["sessions"] if entry["session_id"] == session)
    prompts = [usage["input_tokens"] + usage["cache_read_input_tokens"] for usage in (first, second)]
    cached = first["cache_read_input_tokens"] + second["cache_read_input_tokens"]
    assert entry["calls"] == 2 and entry["rank_id"] == rank and entry["ranks_used"] == 1, entry
    assert entry["prompt_tokens"] == sum(prompts), (entry, prompts)
    assert entry["l0_cached_tokens"] + entry["l1_cached_tokens"] == cached, (entry, first, second)
    assert entry["l0_cached_tokens"] > first["cache_read_input_tokens"], (entry, first)  # L0 hits on the second
    assert entry["computed_tokens"] == sum(prompts) - cached == first["input_tokens"] + second["input_tokens"]
    assert entry["cache_hit"] == pytest.approx(cached / sum(prompts), abs=1e-4)
    assert entry["cold_prefills"] == 1, (entry, first)  # the first turn: a new session's whole context
    assert entry["output_tokens"] == first["output_tokens"] + second["output_tokens"]
    sent = stack.scrape("gateway")["kvserve_gateway_session_reports"].samples
    assert {s.labels["outcome"]: s.value for s in sent if s.name.endswith("_total")}["sent"] >= 2, sent
