"""Fuzzed request bodies against the real gateway and rank worker: never a 5xx, and both still serve."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_processes import gateway_stack

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.floats(allow_nan=False, width=32) | st.text(max_size=20),
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
    st.fixed_dictionaries(
        {"role": roles, "content": st.text(max_size=40) | st.lists(blocks, max_size=3) | json_values}
    ),
    max_size=3,
)
bodies = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["default", "claude-3", "", "x" * 300]) | json_values,
        "messages": messages | json_values,
    },
    optional={
        "max_tokens": st.integers(-3, 6) | json_values,
        "max_completion_tokens": st.integers(-3, 6),
        "stream": st.booleans(),
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


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # A short context bounds the work any accepted fuzz body can cause.
    rank = {"KVSERVE_NUM_KV_BLOCKS": "64", "KVSERVE_MAX_MODEL_LEN": "256", "KVSERVE_MAX_NUM_SEQS": "4"}
    with gateway_stack(tmp_path_factory.mktemp("fuzz-stack"), rank, {}) as url:
        yield url


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, path=st.sampled_from(["/v1/messages", "/v1/chat/completions", "/v1/messages/count_tokens"]))
def test_fuzzed_bodies_never_get_a_5xx(base_url: str, body: dict, path: str) -> None:
    response = httpx.post(
        f"{base_url}{path}", content=json.dumps(body), timeout=120, headers={"content-type": "application/json"}
    )
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400 and "text/event-stream" not in response.headers.get("content-type", ""):
        error = response.json()
        assert ("error" in error) and (error.get("type") == "error" or "message" in error["error"])


def test_still_serving_after_the_fuzz(base_url: str) -> None:
    body = {"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{base_url}/v1/messages", json=body, timeout=60).status_code == 200
    assert httpx.get(f"{base_url}/ready").status_code == 200
