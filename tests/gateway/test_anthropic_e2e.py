"""The Anthropic Messages API through real processes (rank worker with the embedded SmolLM2 + gateway),
judged by the official `anthropic` SDK and by raw HTTP where the SDK would hide the wire format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest
from service_processes import gateway_stack, request_log_line

MODEL = "default"
GREEDY = {"temperature": 0}  # the SDK no longer takes temperature as an argument; the API still does
SYSTEM = (
    "You are a careful assistant for a software team. You answer briefly and precisely. "
    "When you are not sure, you say so. You never invent file names, functions or APIs. "
) * 6


@pytest.fixture(scope="module")
def stack_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("anthropic-stack")


@pytest.fixture(scope="module")
def base_url(stack_dir: Path) -> Iterator[str]:
    tmp = stack_dir
    rank = {"KVSERVE_NUM_KV_BLOCKS": "512", "KVSERVE_MAX_MODEL_LEN": "4096", "KVSERVE_MAX_NUM_SEQS": "8"}
    gateway = {"KVSERVE_MAX_REQUEST_BYTES": str(256 * 1024), "KVSERVE_DEPLOYMENT_SLUG": "smol-local"}
    with gateway_stack(tmp, rank, gateway) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused-in-open-local-mode", max_retries=0)


def _events(base_url: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """Raw SSE (event name, data) pairs, to check the wire order the SDK would smooth over."""
    events = []
    with httpx.stream("POST", f"{base_url}/v1/messages?beta=true", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                events.append((name, data))
    return events


def test_plain_message(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model=MODEL,
        max_tokens=20,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body=GREEDY,
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.stop_reason in ("end_turn", "max_tokens")
    text = "".join(block.text for block in message.content if block.type == "text")
    assert "Paris" in text
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 10
    assert 0 < message.usage.output_tokens <= 20


def test_streaming_event_order(base_url: str) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Count: one, two,"}],
    }
    events = _events(base_url, body)
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and "input_tokens" in start["usage"]
    blocks = names[1:-2]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) == {"content_block_delta"}
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 8


def test_sdk_stream_accumulates_the_same_message(client: anthropic.Anthropic) -> None:
    kwargs = dict(model=MODEL, max_tokens=10, extra_body=GREEDY, messages=[{"role": "user", "content": "Say hello."}])
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    plain = client.messages.create(**kwargs)
    assert [b.text for b in streamed.content] == [b.text for b in plain.content]
    assert streamed.usage.output_tokens == plain.usage.output_tokens


def test_identical_second_request_reads_most_input_from_cache(client: anthropic.Anthropic) -> None:
    kwargs = dict(
        model="smol-local",
        max_tokens=4,
        extra_body=GREEDY,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Which file holds the config schema?"}],
    )
    first = client.messages.create(**kwargs)
    second = client.messages.create(**kwargs)
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert total == first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens / total > 0.9


def test_count_tokens_equals_the_engine_prompt(client: anthropic.Anthropic) -> None:
    request = dict(model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "How many tokens is this?"}])
    counted = client.messages.count_tokens(**request).input_tokens
    message = client.messages.create(max_tokens=1, **request)
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_tool_use_round_trip_is_accepted_and_rendered(client: anthropic.Anthropic) -> None:
    tools = [
        {
            "name": "read_file",
            "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        }
    ]
    conversation = [
        {"role": "user", "content": "What is in README.md?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": ""},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "README.md"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "# kvserve"}]},
                {"type": "text", "text": "Summarise it.", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    message = client.messages.create(model=MODEL, max_tokens=8, tools=tools, messages=conversation, extra_body=GREEDY)
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=MODEL, tools=tools, messages=conversation).input_tokens
    without_tools = client.messages.count_tokens(model=MODEL, messages=conversation).input_tokens
    assert counted > without_tools  # the tool definitions are in the prompt


def test_claude_code_shaped_request(base_url: str) -> None:
    """What Claude Code sends: beta query and headers, adaptive thinking, context_management, metadata with
    a session, ctx/system roles, an attribution line in the system prompt, and max_tokens 32000."""
    body = {
        "model": MODEL,
        "max_tokens": 32000,
        # Greedy, so the reply's length is the model's and not a draw: sampled at temperature 1, SmolLM2 now and
        # then runs on to the 4096-token context, which took this test past its 10 minutes on a busy CI machine.
        "temperature": 0,
        "stream": True,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "s-123"})},
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.1.abc; cc_entrypoint=cli; cch=00000;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "ctx", "content": "Working directory: /tmp"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "some_future_field": {"x": 1},
    }
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "x-claude-code-session-id": "s-123",
        "user-agent": "claude-cli/2.1.332 (external, sdk-cli)",
    }
    events = _events(base_url, {**body, "max_tokens": 32000}, headers)
    stop = next(d for n, d in events if n == "message_delta")["delta"]["stop_reason"]
    assert stop in ("end_turn", "max_tokens")
    # The attribution line changes every call; it must not change the prompt.
    body["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.1.abc; cc_entrypoint=cli; cch=99999;"
    counts = [
        httpx.post(
            f"{base_url}/v1/messages/count_tokens",
            json={k: body[k] for k in ("model", "system", "messages")},
            timeout=30,
        ).json()["input_tokens"]
        for _ in range(2)
    ]
    body["system"] = body["system"][1:]
    without = httpx.post(
        f"{base_url}/v1/messages/count_tokens", json={k: body[k] for k in ("model", "system", "messages")}, timeout=30
    ).json()["input_tokens"]
    assert counts[0] == counts[1] == without


def test_models_lists_served_names(client: anthropic.Anthropic, base_url: str) -> None:
    ids = [m.id for m in client.models.list().data]
    assert "default" in ids and "smol-local" in ids and len(ids) == 3
    # the context size, as vLLM reports it (load generators size their prompts by it)
    assert {m["max_model_len"] for m in httpx.get(f"{base_url}/v1/models").json()["data"]} == {4096}


@pytest.mark.parametrize("model", ["claude-sonnet-4-5", "gpt-4o", ""])
def test_unknown_model_is_a_400_naming_the_served_ones(client: anthropic.Anthropic, model: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert f"Model {model or '(none)'} is not available on this endpoint" in error["message"]
    assert "smol-local" in error["message"]


def test_bad_requests_get_400_in_the_api_shape(base_url: str) -> None:
    cases = [
        b"{not json",
        b"[]",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(),  # no max_tokens
        json.dumps({"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}).encode(),
        json.dumps({"model": MODEL, "max_tokens": 5, "messages": [{"role": "wizard", "content": "hi"}]}).encode(),
        json.dumps({"model": MODEL, "max_tokens": 5, "temperature": -1, "messages": []}).encode(),
    ]
    for raw in cases:
        r = httpx.post(f"{base_url}/v1/messages", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_prompt_over_the_context_is_refused_but_max_tokens_is_clamped(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "word " * 5000}])
    # Claude Code asks for 32000 on every call (streaming: the SDK insists for such a size). The prompt renders to
    # 4086 tokens (31 of them the template's), leaving 10 to generate before the context is full.
    with client.messages.stream(
        model=MODEL, max_tokens=32000, extra_body=GREEDY, messages=[{"role": "user", "content": "word " * 4055}]
    ) as stream:
        ok = stream.get_final_message()
    assert ok.stop_reason == "max_tokens"  # clamped to what the 4096-token context left
    assert ok.usage.input_tokens + ok.usage.cache_read_input_tokens + ok.usage.output_tokens == 4096


@pytest.mark.parametrize("words", [4065, 5000])  # exactly the 4,096-token window; well past it
def test_count_tokens_refuses_what_messages_refuses(client: anthropic.Anthropic, words: int) -> None:
    # Counted exactly (the byte bound alone does not refuse these): count_tokens gave 200 with the count before.
    request = dict(model=MODEL, messages=[{"role": "user", "content": "word " * words}])
    with pytest.raises(anthropic.BadRequestError) as counted:
        client.messages.count_tokens(**request)
    with pytest.raises(anthropic.BadRequestError) as sent:
        client.messages.create(max_tokens=5, **request)
    assert counted.value.body == sent.value.body  # the same check, error shape and message
    error = counted.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and "at least" not in error["message"]
    # one token a word, plus the template's 31 (as above)
    assert error["message"].startswith(f"prompt is too long: {words + 31} tokens, and this model's context is 4096")
    fits = [{"role": "user", "content": "word " * 4064}]  # one token less than the window: counted
    assert client.messages.count_tokens(model=MODEL, messages=fits).input_tokens == 4095


def test_body_over_the_limit_is_413(base_url: str) -> None:
    big = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 300_000}]}
    r = httpx.post(f"{base_url}/v1/messages", json=big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_health_ready_and_metrics(base_url: str, client: anthropic.Anthropic) -> None:
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert httpx.get(f"{base_url}/ready").json()["status"] == "ready"
    client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'kvserve_gateway_requests_total{api="anthropic",status="200"}' in metrics
    assert "kvserve_gateway_time_to_first_token_seconds_bucket" in metrics


def test_request_line_times_the_prepare_inside_the_time_to_first_token(
    stack_dir: Path, client: anthropic.Anthropic
) -> None:
    text = "count the words of this long prompt " * 300  # ~2K tokens to tokenize
    reply = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": text}])
    log = stack_dir / "gateway.log"
    line = request_log_line(log, f"request id={reply.id} ")  # written once the response is out: waited for
    assert sum(f"request id={reply.id} " in each for each in log.read_text().splitlines()) == 1
    fields = dict(pair.split("=", 1) for pair in line.split("request ", 1)[1].split(" "))
    prepare_ms, ttft_ms = float(fields["prepare_ms"]), float(fields["ttft_ms"])
    assert 0 < float(fields["tokenize_ms"]) <= prepare_ms <= ttft_ms  # the time to first token counts from arrival


def test_stop_sequence_cuts_the_answer_and_still_reports_usage(client: anthropic.Anthropic) -> None:
    kwargs = dict(
        model=MODEL,
        max_tokens=20,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    full = "".join(b.text for b in client.messages.create(**kwargs).content if b.type == "text")
    cut_word = full.split()[2]
    stopped = client.messages.create(stop_sequences=[cut_word], **kwargs)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == cut_word
    text = "".join(b.text for b in stopped.content if b.type == "text")
    assert cut_word not in text and full.startswith(text)
    assert stopped.usage.cache_read_input_tokens > 0  # known from the first chunk, though we stopped reading


def test_ignore_eos_generates_exactly_max_tokens(client: anthropic.Anthropic) -> None:
    # "Say OK." ends within a few tokens; with the ignore_eos extension (load generators) it runs to the cap
    short = client.messages.create(
        model="default", max_tokens=40, messages=[{"role": "user", "content": "Say OK."}], extra_body={"temperature": 0}
    )
    forced = client.messages.create(
        model="default",
        max_tokens=40,
        messages=[{"role": "user", "content": "Say OK."}],
        extra_body={"temperature": 0, "ignore_eos": True},
    )
    assert short.usage.output_tokens < 40 and short.stop_reason == "end_turn"
    assert forced.usage.output_tokens == 40 and forced.stop_reason == "max_tokens"
