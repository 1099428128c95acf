"""One request id end to end: the id a client gets (the message id, and the response's request id header) is
the one the gateway's request log, the router's route line and the rank's lines about the request carry, so
one request can be followed through every service's log; a stream continued on another rank after n tokens
is `<id>+n` there. Real processes: redis-server, kvstore, router, two rank workers, gateway; the official
SDKs as clients."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from service_processes import request_log_line
from whole_stack import Stack, whole_stack

MAX_MODEL_LEN = 256
RANK_SETTINGS = {"KVSERVE_NUM_KV_BLOCKS": "64", "KVSERVE_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with whole_stack(tmp_path_factory.mktemp("request-id"), ranks=2, rank_settings=RANK_SETTINGS) as s:
        yield s


def log_line_with(log: Path, pattern: str, timeout_s: float = 30) -> str:
    """The first line of `log` that matches the regex `pattern`, waited for: a service writes its line about a
    request around the time the client has its answer, not necessarily before."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if re.search(pattern, line):
                return line
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r} in {log.name}: {log.read_text(errors='replace')[-3000:]}")


def request_field(request_id: str) -> str:
    """`request=<id>` as a whole field: not a continuation's `<id>+n`, nor another id it is the start of."""
    return rf"\brequest={re.escape(request_id)}(\s|:|$)"


def routed_to(stack: Stack, request_id: str) -> str:
    """The rank the router's route line for `request_id` names."""
    route_line = log_line_with(stack["router"].log_path, rf"route {request_field(request_id)}")
    match = re.search(r" rank=(\S+) ", route_line)
    assert match, route_line
    return match.group(1)


def assert_followed_through_the_stack(stack: Stack, request_id: str) -> None:
    gateway_line = request_log_line(stack["gateway"].log_path, f" id={request_id} ")
    rank = routed_to(stack, request_id)
    assert " status=200 " in gateway_line and gateway_line.endswith(f" rank={rank}"), gateway_line
    log_line_with(stack[rank].log_path, rf"accepted {request_field(request_id)}")
    finish_line = log_line_with(stack[rank].log_path, rf"finished {request_field(request_id)}")
    assert " output_tokens=4 " in finish_line, finish_line


def test_an_anthropic_message_id_is_in_every_services_log(stack: Stack) -> None:
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused-in-open-local-mode", max_retries=0)
    raw = client.messages.with_raw_response.create(
        model="default",
        max_tokens=4,
        messages=[{"role": "user", "content": "Name one colour."}],
        extra_body={"temperature": 0, "ignore_eos": True},
    )
    message = raw.parse()
    assert message.id.startswith("msg_")
    assert_followed_through_the_stack(stack, message.id)
    assert raw.headers["request-id"] == message.id  # where the SDK's _request_id comes from


def test_an_openai_stream_id_is_in_every_services_log(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused-in-open-local-mode", max_retries=0)
    with client.chat.completions.with_streaming_response.create(
        model="default",
        max_tokens=4,
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": "Name one animal."}],
        extra_body={"ignore_eos": True},
    ) as response:
        header = response.headers["x-request-id"]
        chunk_ids = {chunk.id for chunk in response.parse()}
    assert chunk_ids == {header} and header.startswith("chatcmpl-")
    assert_followed_through_the_stack(stack, header)


def test_a_refused_request_names_its_id_too(stack: Stack) -> None:
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused-in-open-local-mode", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long") as refused:
        client.messages.create(
            model="default", max_tokens=4, messages=[{"role": "user", "content": "word " * (2 * MAX_MODEL_LEN)}]
        )
    request_id = refused.value.request_id
    assert request_id is not None and request_id.startswith("msg_")
    line = request_log_line(stack["gateway"].log_path, f" id={request_id} ")
    assert " status=400 " in line and " error=invalid_request_error" in line, line


def test_a_stream_continued_on_another_rank_keeps_its_id(stack: Stack) -> None:
    """Last in this file: it kills the rank that serves the stream."""
    body = {
        "model": "default",
        "max_tokens": 40,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell a long story."}],
    }
    names: list[str] = []
    home = ""
    with httpx.stream("POST", f"{stack.url}/v1/messages", json=body, timeout=300) as response:
        request_id = response.headers["request-id"]
        for line in response.iter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
            if names.count("content_block_delta") == 3 and not home:  # mid-stream: the serving rank dies
                home = routed_to(stack, request_id)
                stack[home].kill()
    assert names[-1] == "message_stop" and "error" not in names, names
    survivor = next(name for name in stack.rank_names() if name != home)

    continued = log_line_with(stack["router"].log_path, rf"route request={re.escape(request_id)}\+\d+ ")
    resumed_after = int(re.search(r"\+(\d+) ", continued).group(1))  # type: ignore[union-attr]
    continued_id = f"{request_id}+{resumed_after}"
    assert resumed_after >= 3 and f" rank={survivor} " in continued, continued
    log_line_with(stack["router"].log_path, rf"rank {home} marked down: reported failed by {request_field(request_id)}")
    finish_line = log_line_with(stack[survivor].log_path, rf"finished {request_field(continued_id)}")
    assert f" output_tokens={40 - resumed_after} " in finish_line, finish_line
    gateway_line = request_log_line(stack["gateway"].log_path, f" id={request_id} ")
    assert " status=200 " in gateway_line and " output_tokens=40 " in gateway_line, gateway_line
    assert f" rank={survivor} rank_switches=1" in gateway_line, gateway_line
