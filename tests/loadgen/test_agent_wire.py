"""The HTTP side without a server: request bodies, SSE parsing and timing, gateway probes (httpx mocks)."""

from __future__ import annotations

import asyncio
import json

import httpx

from loadgen.content import ASSISTANT_REPLY, Prompt
from loadgen.gateway_info import cached_tokens_by_tier, probe_context, served_model
from loadgen.wire import CallOutcome, request_body, stream_call

PROMPT = Prompt(system="sys words", user="user words")


def _sse(events: list[tuple[str, dict]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


def _call(api: str, status: int, content: bytes) -> tuple[CallOutcome, dict]:
    seen: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"] = request.url.path
        seen["body"] = json.loads(request.content)
        return httpx.Response(status, content=content, headers={"content-type": "text/event-stream"})

    async def run() -> CallOutcome:
        async with httpx.AsyncClient(base_url="http://gw", transport=httpx.MockTransport(handler)) as client:
            body = request_body(api, "m", PROMPT, 3, True, "sess-1")  # type: ignore[arg-type]
            return await stream_call(client, api, body)  # type: ignore[arg-type]

    return asyncio.run(run()), seen


def test_request_bodies_carry_session_and_ignore_eos() -> None:
    anthropic = request_body("anthropic", "m", PROMPT, 7, True, "s-9")
    assert anthropic["system"] == "sys words" and anthropic["messages"] == [{"role": "user", "content": "user words"}]
    assert anthropic["stream"] and anthropic["max_tokens"] == 7 and anthropic["ignore_eos"] is True
    assert json.loads(anthropic["metadata"]["user_id"]) == {"session_id": "s-9"}
    openai = request_body("openai", "m", PROMPT, 7, False, "s-9")
    assert openai["messages"][0] == {"role": "system", "content": "sys words"} and openai["user"] == "s-9"
    assert openai["stream_options"] == {"include_usage": True} and "ignore_eos" not in openai


def test_a_conversation_of_turns_goes_as_messages_with_the_fixed_reply_between() -> None:
    prompt = Prompt(system="sys", user="one two three", user_turns=("one", "two", "three"))
    reply = {"role": "assistant", "content": ASSISTANT_REPLY}
    turns = [{"role": "user", "content": "one"}, reply, {"role": "user", "content": "two"}, reply]
    expected = [*turns, {"role": "user", "content": "three"}]
    assert request_body("anthropic", "m", prompt, 7, True, "s")["messages"] == expected
    assert request_body("openai", "m", prompt, 7, True, "s")["messages"] == [
        {"role": "system", "content": "sys"},
        *expected,
    ]


def test_anthropic_stream_usage_and_timing() -> None:
    events = [
        ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 1000, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}}),
        ("ping", {"type": "ping"}),
        *[("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}})] * 3,
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "usage": {"input_tokens": 40, "cache_read_input_tokens": 960, "output_tokens": 3},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    outcome, seen = _call("anthropic", 200, _sse(events))
    assert seen["path"] == "/v1/messages" and seen["body"]["ignore_eos"] is True
    assert outcome.error is None and outcome.ttft_s is not None and outcome.ttft_s >= 0 and outcome.decode_s >= 0
    assert (outcome.input_tokens, outcome.cached_tokens, outcome.output_tokens) == (1000, 960, 3)


def test_openai_stream_usage_and_timing() -> None:
    chunks = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [{"delta": {"content": "b"}}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 500, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 448}},
        },
    ]
    content = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
    outcome, seen = _call("openai", 200, content)
    assert seen["path"] == "/v1/chat/completions"
    assert outcome.error is None and outcome.ttft_s is not None
    assert (outcome.input_tokens, outcome.cached_tokens, outcome.output_tokens) == (500, 448, 2)


def test_errors_are_recorded_not_raised() -> None:
    outcome, _ = _call("anthropic", 529, b'{"type":"error","error":{"type":"overloaded_error","message":"busy"}}')
    assert outcome.error == "http 529" and outcome.ttft_s is None
    mid_stream = _sse(
        [
            ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 5}}}),
            ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "rank lost"}}),
        ]
    )
    outcome, _ = _call("anthropic", 200, mid_stream)
    assert outcome.error == "overloaded_error"
    outcome, _ = _call("anthropic", 200, b"")
    assert outcome.error == "no content"


def test_gateway_probes() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "small", "type": "model"}, {"id": "default"}]})
        if request.url.path == "/v1/messages":
            message = "prompt is too long: 2200003 tokens, and this model's context is 4096 tokens (at most 4095 ...)"
            return httpx.Response(
                400, json={"type": "error", "error": {"type": "invalid_request_error", "message": message}}
            )
        metrics = (
            "# TYPE kvserve_gateway_cached_tokens_total counter\n"
            'kvserve_gateway_cached_tokens_total{tier="l0"} 1234.0\n'
            'kvserve_gateway_cached_tokens_total{tier="l1"} 5.0\n'
        )
        return httpx.Response(200, text=metrics)

    with httpx.Client(base_url="http://gw", transport=httpx.MockTransport(handler)) as client:
        assert served_model(client) == ("small", None)
        assert probe_context(client, "small") == 4096
        assert cached_tokens_by_tier(client) == {"l0": 1234.0, "l1": 5.0}


def test_listed_context_wins() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": [{"id": "big", "max_model_len": 131072}]})

    with httpx.Client(base_url="http://gw", transport=httpx.MockTransport(handler)) as client:
        assert served_model(client) == ("big", 131072)
