"""The gateway's edges with real processes (a rank worker with the embedded SmolLM2 and a gateway with API keys
on), driven by raw sockets where a client library would hide the wire: incomplete requests time out, client
disconnects are logged as cancelled with what was streamed, the log's status is the one sent, the in-flight
gauge counts open streams, /metrics and /docs need a key (for /metrics, one with the metrics scope), a trailing
slash is answered without a redirect, keys created or revoked with `kvserve keys` apply to the running gateway,
a key file with bytes that are not UTF-8 keeps the last good keys, and a key for one name of the served model
may use all its names."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from service_processes import ROOT, gateway_stack, request_log_line, service_env

from gateway.http.auth import create_key

READ_TIMEOUT_S = 2.0  # request_read_timeout_secs of the gateway under test
SYSTEM = "You are a careful assistant for a software team. You answer briefly and precisely. " * 8


@dataclass
class Stack:
    url: str
    port: int
    log: Path
    keys_file: Path
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"x-api-key": self.key}

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def request_line(self, since: int, pattern: str, timeout_s: float = 30) -> str:
        """The first request log line after byte offset `since` that contains `pattern`."""
        return request_log_line(self.log, pattern, since, timeout_s)

    def log_through_a_later_request(self, since: int) -> str:
        """The log from offset `since` through the line of a request sent now and answered: whatever the
        gateway wrote about the requests before it (an ASGI traceback comes right after their own line) is in."""
        marker = f"marker-{uuid.uuid4().hex[:8]}"
        headers = {**self.auth, "x-claude-code-session-id": marker}
        response = httpx.post(f"{self.url}/v1/messages", json=chat_body(max_tokens=1), headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        self.request_line(since, f"session={marker}")
        return self.log_text()[since:]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("edges-stack")
    keys_file = tmp / "keys.json"
    key = create_key(keys_file, "tests", ["*"], ["metrics"])
    rank = {"KVSERVE_NUM_KV_BLOCKS": "512", "KVSERVE_MAX_MODEL_LEN": "2048", "KVSERVE_MAX_NUM_SEQS": "8"}
    gateway = {
        "KVSERVE_API_KEYS_FILE": str(keys_file),
        "KVSERVE_REQUEST_READ_TIMEOUT_SECS": str(READ_TIMEOUT_S),
        "KVSERVE_PING_INTERVAL_SECS": "0.5",
    }
    with gateway_stack(tmp, rank, gateway) as url:
        yield Stack(url, int(url.rsplit(":", 1)[1]), tmp / "gateway.log", keys_file, key)


def fields(line: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line.split(" request ", 1)[1]))


def raw_exchange(port: int, data: bytes, close_after_send: bool = False, timeout_s: float = 30) -> tuple[bytes, float]:
    """Send `data` on a fresh connection, then read until the server closes it (or, with close_after_send,
    close it at once). Returns what came back and how long the server took to close."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        started = time.monotonic()
        sock.sendall(data)
        if close_after_send:
            return b"", 0.0
        received = b""
        while chunk := sock.recv(65536):  # socket.timeout (a failure) when the server holds the connection
            received += chunk
        return received, time.monotonic() - started


def body_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def chat_body(content: str = "Say hello.", max_tokens: int = 8, **extra: object) -> dict:
    return {"model": "default", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}], **extra}


def post_head(stack: Stack, content_length: int, path: str = "/v1/messages") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: {stack.key}\r\n"
        f"content-type: application/json\r\ncontent-length: {content_length}\r\n\r\n"
    ).encode()


# --- point 8: incomplete requests are timed out ---


@pytest.mark.parametrize(
    "partial",
    [b"", b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le", b"GET /hea"],
    ids=["nothing", "half-headers", "half-request-line"],
)
def test_unfinished_headers_are_closed_after_the_read_timeout(stack: Stack, partial: bytes) -> None:
    received, took = raw_exchange(stack.port, partial)
    assert took < READ_TIMEOUT_S + 10, took
    assert received == b"" or received.startswith(b"HTTP/1.1 408 "), received


def test_a_body_shorter_than_its_content_length_gets_408_in_the_api_shape(stack: Stack) -> None:
    since = len(stack.log_text())
    partial = json.dumps(chat_body()).encode()[:20]
    for path, shape in (("/v1/messages", "anthropic"), ("/v1/chat/completions", "openai")):
        received, took = raw_exchange(stack.port, post_head(stack, 5000, path) + partial)
        assert took < READ_TIMEOUT_S + 10, took
        assert received.startswith(b"HTTP/1.1 408 "), received
        error = body_of(received)["error"]
        assert error["type"] == "timeout_error"
        if shape == "anthropic":
            assert body_of(received)["type"] == "error"
    assert "status=408" in stack.request_line(since, "api=anthropic")
    assert "Traceback" not in stack.log_text()[since:]
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200


# --- point 7: disconnects are cancellations; the log's status is the one sent ---


def test_a_client_gone_mid_body_is_logged_cancelled_without_a_traceback(stack: Stack) -> None:
    since = len(stack.log_text())
    raw_exchange(stack.port, post_head(stack, 5000) + b'{"model": "default", ', close_after_send=True)
    line = stack.request_line(since, "api=anthropic")
    assert fields(line)["status"] == "499" and fields(line)["finish"] == "cancelled", line
    assert "Traceback" not in stack.log_through_a_later_request(since)


def test_a_non_streaming_request_whose_client_leaves_is_logged_cancelled(stack: Stack) -> None:
    since = len(stack.log_text())
    session = f"leaving-{uuid.uuid4().hex[:8]}"
    body = chat_body("Write a very long story about a lighthouse.", max_tokens=600, ignore_eos=True)
    headers = {**stack.auth, "x-claude-code-session-id": session}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/v1/messages", json=body, headers=headers, timeout=httpx.Timeout(10, read=4))
    line = stack.request_line(since, f"session={session}")
    assert fields(line)["status"] == "499" and fields(line)["finish"] == "cancelled", line
    assert int(fields(line)["output_tokens"]) > 0, line  # what the rank produced before the cancel
    logged = stack.log_through_a_later_request(since)
    assert "Traceback" not in logged and "Exception in ASGI" not in logged


def test_a_model_name_with_a_lone_surrogate_is_answered_and_logged_with_one_status(stack: Stack) -> None:
    since = len(stack.log_text())
    session = f"surrogate-{uuid.uuid4().hex[:8]}"
    raw = b'{"model": "x\\ud800", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}'
    headers = {**stack.auth, "content-type": "application/json", "x-claude-code-session-id": session}
    response = httpx.post(f"{stack.url}/v1/messages", content=raw, headers=headers, timeout=30)
    assert response.headers["content-type"].startswith("application/json"), response.text
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    line = stack.request_line(since, "api=anthropic")
    assert fields(line)["status"] == str(response.status_code), line
    # the connection is still good for the next request
    with httpx.Client(base_url=stack.url, headers=stack.auth, timeout=30) as client:
        assert client.post("/v1/messages", content=raw, headers=headers).status_code == 400
        assert client.get("/v1/models").status_code == 200


# --- point 22: an abandoned request logs what it streamed and what was cached ---


def test_an_abandoned_stream_logs_its_tokens_and_cache_hit(stack: Stack) -> None:
    body = {**chat_body("Tell me a long story about a cache.", max_tokens=300), "system": SYSTEM, "temperature": 0}
    warm = httpx.post(f"{stack.url}/v1/messages", json={**body, "max_tokens": 2}, headers=stack.auth, timeout=120)
    assert warm.status_code == 200, warm.text
    since = len(stack.log_text())
    message_id, deltas = "", 0
    with httpx.stream(
        "POST", f"{stack.url}/v1/messages", json={**body, "stream": True}, headers=stack.auth, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"message_start"' in line:
                message_id = json.loads(line[6:])["message"]["id"]
            deltas += line.startswith("event: content_block_delta")
            if deltas >= 3:
                break  # leaving the block drops the connection mid-stream
    line = stack.request_line(since, f"id={message_id}")
    logged = fields(line)
    assert logged["status"] == "499" and logged["finish"] == "cancelled", line
    assert int(logged["output_tokens"]) >= 3, line
    assert int(logged["cached_tokens"]) > 0 and logged["rank"] != "-", line


# --- point 18: requests in flight ---


def test_in_flight_gauge_counts_open_streams(stack: Stack) -> None:
    body = {**chat_body("Count to a thousand.", max_tokens=400, ignore_eos=True), "stream": True}
    gauge = re.compile(r'^kvserve_gateway_requests_in_flight\{api="anthropic"\} (\S+)$', re.M)

    def in_flight() -> float:
        metrics = httpx.get(f"{stack.url}/metrics", headers=stack.auth, timeout=10)
        return float(gauge.search(metrics.text)[1])  # type: ignore[index]

    with contextlib.ExitStack() as streams:
        for _ in range(4):
            response = streams.enter_context(
                httpx.stream("POST", f"{stack.url}/v1/messages", json=body, headers=stack.auth, timeout=120)
            )
            assert response.status_code == 200
        assert in_flight() == 4
    deadline = time.monotonic() + 30
    while in_flight() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert in_flight() == 0


# --- point 17: what answers without a key; redirects; keys apply without a restart ---


def test_metrics_and_docs_are_not_open_with_keys_on(stack: Stack) -> None:
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
        response = httpx.get(f"{stack.url}{path}", timeout=10)
        assert response.status_code in (401, 404), (path, response.status_code)
    assert httpx.get(f"{stack.url}/metrics", headers=stack.auth, timeout=10).status_code == 200
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200


def test_metrics_need_the_metrics_scope_which_every_model_does_not_include(stack: Stack) -> None:
    every_model = create_key(stack.keys_file, "every-model", ["*"])
    refused = httpx.get(f"{stack.url}/metrics", headers={"x-api-key": every_model}, timeout=10)
    assert refused.status_code == 403, (refused.status_code, refused.text[:200])
    assert refused.json()["error"]["type"] == "permission_error"
    created = kvserve_keys("create", "--name", "scraper", "--metrics", "--file", str(stack.keys_file))
    assert created.returncode == 0, created.stderr
    scraper = {"x-api-key": created.stdout.strip()}
    metrics = httpx.get(f"{stack.url}/metrics", headers=scraper, timeout=10)
    assert metrics.status_code == 200 and "kvserve_gateway_requests_in_flight" in metrics.text
    run = httpx.post(f"{stack.url}/v1/messages", json=chat_body(max_tokens=1), headers=scraper, timeout=60)
    assert run.status_code == 403 and run.json()["error"]["type"] == "permission_error"  # a scraper's key only


def test_a_trailing_slash_is_answered_not_redirected_to_the_host_header(stack: Stack) -> None:
    headers = {**stack.auth, "host": "attacker.example"}
    for method, path, body in (("GET", "/v1/models/", None), ("POST", "/v1/messages/", chat_body(max_tokens=2))):
        response = httpx.request(method, f"{stack.url}{path}", json=body, headers=headers, timeout=60)
        assert response.status_code == 200 and "location" not in response.headers, (path, response.status_code)
    wrong_method = httpx.get(f"{stack.url}/v1/messages", headers=stack.auth, timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"


def kvserve_keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "keys", *args],
        cwd=ROOT,
        env=service_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_keys_created_and_revoked_apply_to_the_running_gateway(stack: Stack) -> None:
    def models(key: str) -> int:
        return httpx.get(f"{stack.url}/v1/models", headers={"x-api-key": key}, timeout=10).status_code

    created = kvserve_keys("create", "--name", "temporary", "--file", str(stack.keys_file))
    assert created.returncode == 0, created.stderr
    new_key = created.stdout.strip()
    assert models(new_key) == 200  # no restart
    revoked = kvserve_keys("revoke", "temporary", "--file", str(stack.keys_file))
    assert revoked.returncode == 0, revoked.stderr
    assert models(new_key) == 401
    assert models(stack.key) == 200  # the other key is untouched


# --- issue 32: bytes that are not UTF-8 in the key file; the names of one model are one scope ---


def replace_file(path: Path, data: bytes) -> None:
    """As an editor saves: a new file renamed over the old one (a new inode, so the gateway sees the change)."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    temporary.write_bytes(data)
    temporary.replace(path)


def test_bytes_that_are_not_utf8_in_the_key_file_keep_the_last_good_keys(stack: Stack) -> None:
    good = stack.keys_file.read_bytes()
    since = len(stack.log_text())
    try:
        replace_file(stack.keys_file, b"\xff\xfe" + good)  # saved in another encoding by a hand edit
        response = httpx.get(f"{stack.url}/v1/models", headers=stack.auth, timeout=10)
        assert response.status_code == 200, response.text  # not a 500 on every request
        logged = stack.log_text()[since:]  # logged before the answer was sent
        assert "ERROR" in logged and "is not valid UTF-8" in logged and "still using the" in logged, logged[-2000:]
    finally:
        replace_file(stack.keys_file, good)
    assert httpx.get(f"{stack.url}/v1/models", headers=stack.auth, timeout=10).status_code == 200


def test_a_key_for_one_name_of_the_served_model_may_use_all_its_names(stack: Stack) -> None:
    listed = httpx.get(f"{stack.url}/v1/models", headers=stack.auth, timeout=10)
    names = [model["id"] for model in listed.json()["data"]]
    assert len(names) >= 2 and names[-1] == "default", names  # the served name first, then its aliases
    keys = {name: create_key(stack.keys_file, f"only-{name}", [name]) for name in (names[0], "default")}
    keys["another-model"] = create_key(stack.keys_file, "another-model", ["another-model"])
    messages = [{"role": "user", "content": "Say hello."}]
    for scope, key in keys.items():
        headers = {"x-api-key": key}
        for name in names:
            counted = httpx.post(
                f"{stack.url}/v1/messages/count_tokens",
                json={"model": name, "messages": messages},
                headers=headers,
                timeout=60,
            )
            sent = httpx.post(
                f"{stack.url}/v1/messages", json={**chat_body(max_tokens=1), "model": name}, headers=headers, timeout=60
            )
            expected = 403 if scope == "another-model" else 200
            assert (counted.status_code, sent.status_code) == (expected, expected), (
                scope,
                name,
                counted.text,
                sent.text,
            )
