"""The fleet tests' client, run inside a network namespace (`ip netns exec NS python tests/fleet/fleet_client.py`):
it reads one JSON request a line on stdin and answers each with one JSON line on stdout, carrying the request's
`tag`, as soon as it is done (requests run concurrently, so answers may come out of order).

Operations:
- anthropic: one call of the official Anthropic SDK (messages.create; `stream` for the streaming form).
- openai: one call of the official OpenAI SDK (chat.completions.create; `stream` with include_usage).
- http: one plain HTTP request (readiness, metrics, Envoy's admin).
- wait_http: an HTTP GET repeated until it answers `status` (and holds `contains`), within `timeout_s`.

The SDKs retry only when a request says so (`max_retries`, 0 by default): every other failure is reported as it
happened. Only the standard library, httpx and the SDKs are imported: this runs as a script, not as part of the
test suite.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

SESSION_HEADER = "x-claude-code-session-id"


def _usage(usage: Any) -> dict[str, Any]:
    return usage.model_dump(mode="json") if usage is not None else {}


def anthropic_call(request: dict[str, Any]) -> dict[str, Any]:
    import anthropic

    client = anthropic.Anthropic(
        base_url=request["base_url"],
        api_key=request["api_key"],
        max_retries=request.get("max_retries", 0),
        timeout=request.get("timeout_s", 300),
    )
    arguments = {
        "model": request.get("model", "default"),
        "max_tokens": request.get("max_tokens", 8),
        "messages": request["messages"],
        "extra_headers": {SESSION_HEADER: request["session"]} if request.get("session") else None,
        "extra_body": {"temperature": 0},  # greedy; this SDK's messages.create has no temperature argument
    }
    if request.get("system"):
        arguments["system"] = request["system"]
    if not request.get("stream"):
        message = client.messages.create(**arguments)
        text = "".join(block.text for block in message.content if block.type == "text")
        return {"id": message.id, "text": text, "usage": _usage(message.usage), "stop_reason": message.stop_reason}
    with client.messages.stream(**arguments) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    return {"id": message.id, "text": text, "usage": _usage(message.usage), "stop_reason": message.stop_reason}


def openai_call(request: dict[str, Any]) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(
        base_url=request["base_url"] + "/v1",
        api_key=request["api_key"],
        max_retries=request.get("max_retries", 0),
        timeout=request.get("timeout_s", 300),
    )
    messages = request["messages"]
    if request.get("system"):
        messages = [{"role": "system", "content": request["system"]}, *messages]
    arguments = {
        "model": request.get("model", "default"),
        "max_tokens": request.get("max_tokens", 8),
        "temperature": 0,
        "messages": messages,
        "user": request.get("session") or None,
        "extra_headers": {SESSION_HEADER: request["session"]} if request.get("session") else None,
    }
    if not request.get("stream"):
        completion = client.chat.completions.create(**arguments)
        choice = completion.choices[0]
        return {"id": completion.id, "text": choice.message.content or "", "usage": _usage(completion.usage)}
    pieces, usage, completion_id = [], None, ""
    for chunk in client.chat.completions.create(**arguments, stream=True, stream_options={"include_usage": True}):
        completion_id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return {"id": completion_id, "text": "".join(pieces), "usage": _usage(usage)}


def http_call(request: dict[str, Any]) -> dict[str, Any]:
    response = httpx.request(
        request.get("method", "GET"),
        request["url"],
        headers=request.get("headers"),
        json=request.get("json"),
        params=request.get("params"),
        timeout=request.get("timeout_s", 10),
    )
    return {"status": response.status_code, "text": response.text[: request.get("max_chars", 200_000)]}


def wait_http(request: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + request.get("timeout_s", 60)
    last = ""
    while time.monotonic() < deadline:
        try:
            response = httpx.get(request["url"], headers=request.get("headers"), timeout=2)
            last = f"{response.status_code} {response.text[:200]}"
            if response.status_code == request.get("status", 200) and request.get("contains", "") in response.text:
                return {"status": response.status_code, "text": response.text[:2000]}
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(request.get("interval_s", 0.1))
    raise TimeoutError(f"{request['url']} not as expected after {request.get('timeout_s', 60)} s; last: {last}")


OPERATIONS = {"anthropic": anthropic_call, "openai": openai_call, "http": http_call, "wait_http": wait_http}


def _status_of(error: BaseException) -> int | None:
    status = getattr(error, "status_code", None)
    return status if isinstance(status, int) else None


def serve(requests: Any, answers: Any) -> None:
    lock = threading.Lock()

    def run(request: dict[str, Any]) -> None:
        started, started_at = time.monotonic(), time.time()  # wall clock: the test compares it with its own events
        try:
            answer = {"ok": True, **OPERATIONS[request["op"]](request)}
        except Exception as error:  # every failure goes back to the test, as data
            answer = {"ok": False, "error": type(error).__name__, "message": str(error)[:2000]}
            answer["status"] = _status_of(error)
        answer.update(tag=request["tag"], started_at=started_at, elapsed_s=time.monotonic() - started)
        with lock:
            answers.write(json.dumps(answer) + "\n")
            answers.flush()

    with ThreadPoolExecutor(max_workers=64) as pool:
        answers.write(json.dumps({"tag": "ready"}) + "\n")
        answers.flush()
        for line in requests:
            if line.strip():
                pool.submit(run, json.loads(line))


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
