"""Bad input through a real gateway and rank worker (issue 12 point 5 and `messages: []` of point 21): deep
nesting, lone surrogates (content, system, tool names, model) and a conversation that starts with a tool
result each get a 400 invalid_request_error in the API's own shape, on /v1/messages, count_tokens and
/v1/chat/completions, streaming or not; the same keep-alive connection then serves the next request. Sent
as hand-built bytes (a lone surrogate only exists as a JSON escape) and through the SDKs where they can."""

from __future__ import annotations

import json
from collections.abc import Callable

import anthropic
import openai
import pytest
from raw_http import RawConnection, RawResponse
from small_stack import SmallStack

MESSAGES, COUNT, CHAT = "/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"
DEEP = "[" * 10_000 + "]" * 10_000
SURROGATE = "\\ud800"  # as it appears in the JSON text


def anthropic_body(stream: bool, **fields: str) -> str:
    """Body text for /v1/messages (and count_tokens): `fields` are raw JSON texts."""
    parts = {
        "model": '"default"',
        "max_tokens": "3",
        "stream": json.dumps(stream),
        "messages": '[{"role": "user", "content": "hi"}]',
        **fields,
    }
    return "{" + ", ".join(f'"{name}": {value}' for name, value in parts.items()) + "}"


def openai_body(stream: bool, **fields: str) -> str:
    return anthropic_body(stream, **fields)  # the same fields, as far as these cases go


TOOL = '{{"name": "{name}", "description": "d", "input_schema": {{"type": "object"}}}}'
OPENAI_TOOL = '{{"type": "function", "function": {{"name": "{name}", "parameters": {{"type": "object"}}}}}}'

# case -> body text for the Anthropic paths and for the OpenAI path
CASES: dict[str, tuple[Callable[[bool], str], Callable[[bool], str]]] = {
    "deep-nesting": (
        lambda s: anthropic_body(s, metadata=DEEP),
        lambda s: openai_body(s, metadata=DEEP),
    ),
    "deep-tool-input": (
        lambda s: anthropic_body(
            s,
            messages='[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "tool_use", '
            f'"id": "t1", "name": "f", "input": {{"a": {DEEP}}}}}]}}]',
        ),
        lambda s: openai_body(
            s,
            messages='[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "t1", '
            f'"function": {{"name": "f", "arguments": {json.dumps(DEEP)}}}}}]}}]',
        ),
    ),
    "surrogate-in-content": (
        lambda s: anthropic_body(s, messages=f'[{{"role": "user", "content": "hi {SURROGATE}"}}]'),
        lambda s: openai_body(s, messages=f'[{{"role": "user", "content": "hi {SURROGATE}"}}]'),
    ),
    "surrogate-in-system": (
        lambda s: anthropic_body(s, system=f'"be brief {SURROGATE}"'),
        lambda s: openai_body(
            s, messages=f'[{{"role": "system", "content": "x{SURROGATE}"}}, {{"role": "user", "content": "hi"}}]'
        ),
    ),
    "surrogate-in-tool-name": (
        lambda s: anthropic_body(s, tools="[" + TOOL.format(name=f"f{SURROGATE}") + "]"),
        lambda s: openai_body(s, tools="[" + OPENAI_TOOL.format(name=f"f{SURROGATE}") + "]"),
    ),
    "surrogate-in-model": (
        lambda s: anthropic_body(s, model=f'"default{SURROGATE}"'),
        lambda s: openai_body(s, model=f'"default{SURROGATE}"'),
    ),
    "low-surrogate-alone": (
        lambda s: anthropic_body(s, messages='[{"role": "user", "content": "\\udc00 and more"}]'),
        lambda s: openai_body(s, messages='[{"role": "user", "content": "\\udc00 and more"}]'),
    ),
    "starts-with-a-tool-result": (
        lambda s: anthropic_body(
            s, messages='[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}]'
        ),
        lambda s: openai_body(s, messages='[{"role": "tool", "tool_call_id": "t1", "content": "r"}]'),
    ),
    "no-messages": (
        lambda s: anthropic_body(s, messages="[]"),
        lambda s: openai_body(s, messages="[]"),
    ),
}
GOOD = {
    MESSAGES: anthropic_body(False).encode(),
    COUNT: anthropic_body(False).encode(),
    CHAT: openai_body(False).encode(),
}


def assert_invalid_request(response: RawResponse, path: str) -> None:
    assert response.status == 400, (response.status, response.body[:300])
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    if path == CHAT:
        assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    else:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [MESSAGES, COUNT, CHAT])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_400_and_the_connection_serves_on(
    small_stack: SmallStack, case: str, path: str, stream: bool
) -> None:
    if path == COUNT and stream:
        pytest.skip("count_tokens does not stream")
    anthropic_case, openai_case = CASES[case]
    body = (openai_case if path == CHAT else anthropic_case)(stream).encode()
    connection = RawConnection(small_stack.port)
    try:
        assert_invalid_request(connection.post(path, body), path)
        following = connection.post(path, GOOD[path])  # the same keep-alive connection
        assert following.status == 200, following.body[:300]
    finally:
        connection.close()


def test_the_anthropic_sdk_gets_400s(small_stack: SmallStack) -> None:
    client = anthropic.Anthropic(base_url=small_stack.url, api_key="unused", max_retries=0)
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "r"}
    # A lone surrogate cannot go through an SDK (it encodes the body as UTF-8 and fails first): raw bytes above.
    for messages in ([], [{"role": "user", "content": [result]}]):
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError) as refused:
                client.messages.create(model="default", max_tokens=3, messages=messages, stream=stream)  # type: ignore[call-overload]
            assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        with pytest.raises(anthropic.BadRequestError):
            client.messages.count_tokens(model="default", messages=messages)  # type: ignore[arg-type]
    served = client.messages.create(model="default", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert served.usage.output_tokens > 0


def test_the_openai_sdk_gets_400s(small_stack: SmallStack) -> None:
    client = openai.OpenAI(base_url=f"{small_stack.url}/v1", api_key="unused", max_retries=0)
    for messages in ([{"role": "tool", "tool_call_id": "t1", "content": "r"}], []):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="default", max_tokens=3, messages=messages, stream=stream)  # type: ignore[arg-type]
            assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]
