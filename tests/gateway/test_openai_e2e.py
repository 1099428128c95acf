"""The OpenAI Chat Completions API through real processes, judged by the official `openai` SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from service_processes import gateway_stack

MODEL = "default"
SYSTEM = "You are a careful assistant. Answer briefly; never invent APIs or file names. " * 8


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    rank = {"KVSERVE_NUM_KV_BLOCKS": "384", "KVSERVE_MAX_MODEL_LEN": "2048", "KVSERVE_MAX_NUM_SEQS": "8"}
    with gateway_stack(tmp_path_factory.mktemp("openai-stack"), rank, {}) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_plain_completion(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        max_tokens=20,
        temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens > 10 and 0 < completion.usage.completion_tokens <= 20
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_streaming_with_usage_matches_the_plain_answer(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, max_tokens=10, temperature=0, messages=[{"role": "user", "content": "Say hello."}])
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_stream_ends_with_done_and_no_usage_unless_asked(base_url: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(line[6:]) for line in lines[:-1])


def test_cached_tokens_on_a_repeated_prompt(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        max_tokens=3,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Ready?"}],
    )
    client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert second.usage.prompt_tokens_details.cached_tokens / second.usage.prompt_tokens > 0.9


def test_tool_conversation_is_accepted(client: openai.OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    completion = client.chat.completions.create(model=MODEL, max_tokens=8, tools=tools, messages=messages)
    assert completion.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_errors_in_the_openai_shape(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gpt-4o", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert "Model gpt-4o is not available on this endpoint" in info.value.body["message"]
    r = httpx.post(f"{base_url}/v1/chat/completions", content=b'{"model": "default", "messages": []}')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="prompt is too long"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 3000}])


def test_ignore_eos_generates_exactly_max_tokens(client: openai.OpenAI) -> None:
    forced = client.chat.completions.create(
        model="default",
        max_tokens=30,
        messages=[{"role": "user", "content": "Say OK."}],
        extra_body={"temperature": 0, "ignore_eos": True},
    )
    assert forced.usage is not None and forced.usage.completion_tokens == 30
    assert forced.choices[0].finish_reason == "length"
