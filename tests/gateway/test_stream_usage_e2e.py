"""Usage in a stream whose first token comes after pings (a long prefill), through real processes (one rank
worker with the embedded SmolLM2, a gateway that pings every 50 ms): what the rank read from its cache must
reach the client as the rank reported it, on the wire, in what the official SDKs accumulate, on both APIs."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from service_processes import gateway_stack, request_log_line

MODEL = "default"
EXACT = {"temperature": 0, "ignore_eos": True}  # exactly max_tokens tokens
# Shared by every request here, so each one after the first reads it from the cache (~1,000 tokens).
PREFIX = "Tell me about the history of caches in computers, in detail. " * 80


@dataclass(frozen=True)
class Stack:
    url: str
    gateway_log: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stream-usage")
    # Prefill in 128-token steps: a request's uncached part (~500 tokens) takes several, and the gateway pings
    # every 50 ms meanwhile, so the first token always comes after a ping.
    rank = {"KVSERVE_NUM_KV_BLOCKS": "512", "KVSERVE_MAX_MODEL_LEN": "2048", "KVSERVE_MAX_NUM_BATCHED_TOKENS": "128"}
    with gateway_stack(tmp, rank, {"KVSERVE_PING_INTERVAL_SECS": "0.05"}) as url:
        warm = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": prompt()}]}
        assert httpx.post(f"{url}/v1/messages", json=warm, timeout=300).status_code == 200
        yield Stack(url, tmp / "gateway.log")


def prompt() -> str:
    """The shared prefix, then ~500 tokens no request sent before (its tag comes first, so none is cached)."""
    tag = uuid.uuid4().hex
    return PREFIX + f"Question {tag}: " + f"what did {tag[:8]} change about caches? " * 50


def cached_tokens_logged(stack: Stack, request_id: str) -> int:
    """The cache use the rank reported for a request, as the gateway's request line records it."""
    line = request_log_line(stack.gateway_log, f"request id={request_id} ")
    fields = dict(pair.split("=", 1) for pair in line.split("request ", 1)[1].split(" "))
    return int(fields["cached_tokens"])


def test_anthropic_stream_sends_the_cache_read_the_rank_reported(stack: Stack) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "stream": True,
        "messages": [{"role": "user", "content": prompt()}],
        **EXACT,
    }
    events: list[tuple[str, dict]] = []
    with httpx.stream("POST", f"{stack.url}/v1/messages", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                events.append((data["type"], data))
    names = [name for name, _ in events]
    assert "ping" in names[: names.index("content_block_start")]  # the first token came after a ping
    start = events[names.index("message_start")][1]["message"]
    end = events[names.index("message_delta")][1]["usage"]
    cached = cached_tokens_logged(stack, start["id"])
    assert cached >= 900  # the shared prefix (its full blocks)
    # message_start waited for the rank's count (before: 0 and the whole prompt as input_tokens); message_delta
    # carries the final usage in full, as Anthropic's API sends it.
    assert start["usage"]["cache_read_input_tokens"] == cached == end["cache_read_input_tokens"]
    assert start["usage"]["input_tokens"] == end["input_tokens"] > 0
    assert end["cache_creation_input_tokens"] == 0 and end["output_tokens"] == 2


def test_anthropic_sdk_accumulates_the_cache_read(stack: Stack) -> None:
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused-in-open-local-mode", max_retries=0)
    messages = [{"role": "user", "content": prompt()}]
    with client.messages.stream(model=MODEL, max_tokens=2, messages=messages, extra_body=EXACT) as stream:  # type: ignore[arg-type]
        started = next(event for event in stream if event.type == "message_start")
        message = stream.get_final_message()
    cached = cached_tokens_logged(stack, message.id)
    assert cached >= 900
    assert started.message.usage.cache_read_input_tokens == cached  # what a client that reads message_start keeps
    assert message.usage.cache_read_input_tokens == cached
    assert message.usage.input_tokens == started.message.usage.input_tokens > 0 and message.usage.output_tokens == 2


def test_openai_stream_usage_carries_the_cached_tokens(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused-in-open-local-mode", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": prompt()}],
            extra_body=EXACT,
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    cached = cached_tokens_logged(stack, chunks[-1].id)
    assert cached >= 900
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == cached
    assert usage.prompt_tokens > cached and usage.completion_tokens == 2
