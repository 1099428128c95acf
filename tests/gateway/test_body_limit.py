"""BodyLimitMiddleware on a tiny FastAPI app: 413 in the Anthropic or OpenAI shape, for a declared
Content-Length and for a chunked body, without reading a too-large body whole; small bodies pass untouched."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from gateway.http.app import APIS
from gateway.http.body_limit import BodyLimitMiddleware, too_large_error

LIMIT = 1000


class Body(BaseModel):
    text: str


def tiny_app() -> tuple[FastAPI, list[str]]:
    app = FastAPI()
    handled: list[str] = []

    @app.post("/v1/messages")
    async def messages(request: Request) -> dict[str, int]:
        body = await request.body()
        handled.append("messages")
        return {"received": len(body)}

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: Body) -> dict[str, int]:  # FastAPI reads and parses the body itself
        handled.append("count_tokens")
        return {"input_tokens": len(body.text)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, int]:
        body = await request.body()
        handled.append("chat")
        return {"received": len(body)}

    app.add_middleware(BodyLimitMiddleware, max_bytes=LIMIT, apis=APIS)
    return app, handled


def post(app: FastAPI, path: str, content: bytes | AsyncIterator[bytes]) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.post(path, content=content, headers={"content-type": "application/json"})

    return asyncio.run(run())


async def chunks(total: int, size: int = 100) -> AsyncIterator[bytes]:
    sent = 0
    while sent < total:
        piece = min(size, total - sent)
        sent += piece
        yield b"x" * piece


def assert_anthropic_413(response: httpx.Response) -> None:
    assert response.status_code == 413
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    assert str(LIMIT) in body["error"]["message"]
    assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}


def assert_openai_413(response: httpx.Response) -> None:
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert str(LIMIT) in error["message"]
    assert set(response.json()) == {"error"}


@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
def test_413_in_the_anthropic_shape(streamed: bool) -> None:
    app, handled = tiny_app()
    content = chunks(LIMIT + 1) if streamed else b"x" * (LIMIT + 1)
    response = post(app, "/v1/messages?beta=true", content)
    assert_anthropic_413(response)
    assert response.headers["connection"] == "close"
    assert handled == []


@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
def test_413_in_the_openai_shape(streamed: bool) -> None:
    app, handled = tiny_app()
    response = post(app, "/v1/chat/completions", chunks(5 * LIMIT) if streamed else b"x" * (5 * LIMIT))
    assert_openai_413(response)
    assert handled == []


def test_413_when_fastapi_parses_the_body_itself() -> None:
    # FastAPI turns a failed body read into its own 400; the middleware must still answer 413.
    app, handled = tiny_app()
    response = post(app, "/v1/messages/count_tokens", chunks(2 * LIMIT))
    assert_anthropic_413(response)
    assert handled == []


@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
def test_bodies_up_to_the_limit_pass_untouched(streamed: bool) -> None:
    app, handled = tiny_app()
    for path in ("/v1/messages", "/v1/chat/completions"):
        response = post(app, path, chunks(LIMIT) if streamed else b"x" * LIMIT)
        assert response.status_code == 200 and response.json() == {"received": LIMIT}
    small = post(app, "/v1/messages/count_tokens", b'{"text": "hello"}')
    assert small.status_code == 200 and small.json() == {"input_tokens": 5}
    assert handled == ["messages", "chat", "count_tokens"]


class Client:
    """A raw ASGI client that counts how much of the body the app pulled."""

    def __init__(self, body_chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> None:
        self.pending = list(body_chunks)
        self.headers = headers
        self.chunks_read = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        self.chunks_read += 1
        body = self.pending.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(self.pending)}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def call(self, app: Any, path: str) -> None:
        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b""}
        scope |= {"headers": self.headers, "http_version": "1.1", "scheme": "http", "root_path": ""}
        asyncio.run(app(scope, self.receive, self.send))

    @property
    def status(self) -> int:
        return self.sent[0]["status"]


def test_a_chunked_body_is_not_read_past_the_limit() -> None:
    app, _ = tiny_app()
    client = Client([b"x" * 100] * 1000, [(b"transfer-encoding", b"chunked")])  # 100 KB against 1 KB
    client.call(app, "/v1/chat/completions")
    assert client.status == 413
    assert client.chunks_read == LIMIT // 100 + 1
    assert len(client.pending) > 900


def test_a_declared_length_is_refused_before_the_app_runs() -> None:
    app, handled = tiny_app()
    client = Client([b"x" * 10], [(b"content-length", str(10 * LIMIT).encode())])
    client.call(app, "/v1/messages")
    assert client.status == 413 and client.chunks_read == 0 and handled == []


def test_error_shapes_by_path() -> None:
    assert too_large_error(APIS, "/v1/messages", 5)["error"]["type"] == "request_too_large"
    assert too_large_error(APIS, "/v1/messages/count_tokens", 5)["type"] == "error"
    assert too_large_error(APIS, "/v1/chat/completions", 5)["error"]["code"] == "request_too_large"


def test_other_scopes_pass_through() -> None:
    seen: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    asyncio.run(BodyLimitMiddleware(inner, max_bytes=1, apis=APIS)({"type": "lifespan"}, None, None))  # type: ignore[arg-type]
    assert seen == ["lifespan"]
    with pytest.raises(ValueError):
        BodyLimitMiddleware(inner, max_bytes=0, apis=APIS)
