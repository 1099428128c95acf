"""Fuzzed request bodies against the real gateway and rank worker: never a 5xx, errors in the API's own
shape, streams that end properly, and both still serve. The bodies include the bad input of issue 12
(lone surrogates, nesting far past any limit, tool results first, no messages) and streaming requests."""

from __future__ import annotations

import json
import re

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from small_stack import SmallStack

# Text with lone surrogates now and then: json.dumps writes them as \udXXX escapes, valid JSON.
texts = st.text(
    alphabet=st.characters(max_codepoint=0x2FF) | st.sampled_from(["\ud800", "\udfff", "\U0001f600", "é"]),
    max_size=20,
)
# A placeholder that the serialized body replaces with arrays nested that deep (json.dumps could not).
deep = st.integers(100, 5000).map(lambda depth: f"__deep_{depth}__")
_DEEP = re.compile(r'"__deep_(\d+)__"')

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.floats(allow_nan=False, width=32) | texts | deep,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["user", "assistant", "system", "ctx", "msg", "tool", "developer", "robot", ""])
blocks = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "weird"])},
    optional={
        "text": st.text(max_size=30) | json_values,
        "input": json_values,
        "id": st.text(max_size=8),
        "name": st.text(max_size=8),
        "content": json_values,
        "tool_use_id": st.text(max_size=8),
        "thinking": st.text(max_size=10),
        "signature": st.just(""),
    },
)
messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": texts | st.lists(blocks, max_size=3) | json_values}),
    max_size=3,
)
bodies = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["default", "claude-3", "", "x" * 300, "default\ud800"]) | json_values,
        "messages": messages | json_values,
    },
    optional={
        "max_tokens": st.integers(-3, 6) | json_values,
        "max_completion_tokens": st.integers(-3, 6),
        "stream": st.booleans() | st.just(True),
        "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
        "top_p": st.floats(-1, 2, allow_nan=False),
        "top_k": st.integers(-2, 50),
        "stop_sequences": st.lists(st.text(max_size=5), max_size=2) | json_values,
        "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=2),
        "tools": st.lists(
            st.fixed_dictionaries(
                {"name": st.text(max_size=8)},
                optional={"input_schema": json_values, "function": json_values, "type": st.text(max_size=8)},
            ),
            max_size=2,
        )
        | json_values,
        "tool_choice": json_values,
        "system": st.text(max_size=30) | st.lists(blocks, max_size=2) | json_values,
        "thinking": json_values,
        "metadata": json_values,
        "seed": st.integers(-5, 2**70),
        "n": st.integers(-1, 3),
    },
)


def body_text(body: dict) -> str:
    return _DEEP.sub(lambda m: "[" * int(m.group(1)) + "]" * int(m.group(1)), json.dumps(body))


def assert_api_shape(path: str, response: httpx.Response) -> None:
    content_type = response.headers.get("content-type", "")
    if response.status_code >= 400:
        assert content_type.startswith("application/json"), (response.status_code, response.text[:300])
        error = response.json()
        if path.startswith("/v1/chat/"):
            assert set(error) == {"error"} and {"message", "type"} <= set(error["error"]), error
        else:
            assert error["type"] == "error" and {"type", "message"} <= set(error["error"]), error
    elif "text/event-stream" in content_type:  # a stream must end as its API ends one, with no error event
        if path.startswith("/v1/chat/"):
            assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
            assert '"error"' not in response.text, response.text[-300:]
        else:
            assert "event: message_stop" in response.text and "event: error" not in response.text, response.text[-300:]


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, path=st.sampled_from(["/v1/messages", "/v1/chat/completions", "/v1/messages/count_tokens"]))
def test_fuzzed_bodies_never_get_a_5xx(small_stack: SmallStack, body: dict, path: str) -> None:
    response = httpx.post(
        f"{small_stack.url}{path}", content=body_text(body), timeout=120, headers={"content-type": "application/json"}
    )
    assert response.status_code < 500, (response.status_code, response.text[:500])
    assert_api_shape(path, response)


def test_still_serving_after_the_fuzz(small_stack: SmallStack) -> None:
    body = {"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{small_stack.url}/v1/messages", json=body, timeout=60).status_code == 200
    assert httpx.get(f"{small_stack.url}/ready").status_code == 200
