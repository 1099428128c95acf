"""The whole stack (redis-server, kvstore, router, two rank workers, gateway) routing real sessions:
stickiness and L0 hits, load balance for new sessions, and L1 restores of sessions L0 evicted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
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
    restored_reply, usage = chat_turn(stack.url, "bravo", messages, max_tokens=16)
    l1_restored = cached_tokens_metric(stack.url)["l1"] - l1_before
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert l1_restored >= 0.5 * prompt, (l1_restored, usage)
    assert usage["cache_read_input_tokens"] >= l1_restored

    # the same turn cold: neither L0 (evicted again) nor L1 (restarted empty) holds it
    stack["kvstore"].kill()
    stack["kvstore"].start()
    evict_l0(stack, seed=2)
    cold_reply, cold_usage = chat_turn(stack.url, "bravo", messages, max_tokens=16)
    assert cold_usage["cache_read_input_tokens"] < 0.2 * prompt, cold_usage
    assert restored_reply == cold_reply
