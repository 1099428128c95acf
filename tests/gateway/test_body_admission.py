"""BodyAdmissionMiddleware on a tiny FastAPI app, and once through the real app: a body waits for its share
before any of it is read, a chunked one once it has all arrived; no share in time is a 529 in the API's
shape; the share is held until the request is over and its parsed body let go of."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from contracts.config import KvServeConfig
from gateway.http.app import create_app, error_response
from gateway.http.body_admission import BodyAdmissionMiddleware, release_body
from gateway.http.body_budget import BodyBudget
from gateway.http.body_parse import LARGE_BODY_BYTES, parse_request_body
from gateway.http.errors import ApiError

MIN_BYTES = 100  # bodies from this size take a share (the gateway's is INLINE_BODY_BYTES)


class Block(BaseModel):
    text: str


class Body(BaseModel):
    blocks: list[Block]


def tiny_app(budget: BodyBudget) -> tuple[FastAPI, list[Any]]:
    app = FastAPI()
    handled: list[Any] = []

    @app.post("/v1/messages")
    async def messages(request: Request) -> dict[str, int]:
        body = await request.body()
        handled.append(len(body))
        if body.startswith(b"fail"):
            raise ApiError(400, "invalid_request_error", "no")
        return {"received": len(body)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, int]:
        handled.append(len(await request.body()))
        return {}

    @app.post("/v1/messages/parsed")
    async def parsed(request: Request) -> dict[str, int]:
        body = await parse_request_body(request, Body)
        handled.append(body)
        return {"blocks": len(body.blocks)}

    @app.post("/v1/messages/stream")
    async def stream(request: Request) -> StreamingResponse:
        await request.body()

        async def chunks() -> AsyncIterator[bytes]:
            yield b"first"
            handled.append(budget.free_bytes)  # while the stream is still open
            yield b"last"

        return StreamingResponse(chunks())

    @app.post("/v1/messages/released")
    async def released(request: Request) -> StreamingResponse:
        await request.body()
        await release_body(request.scope["state"])  # what serve_chat does once the prompt is built
        await release_body(request.scope["state"])  # once only

        async def chunks() -> AsyncIterator[bytes]:
            yield b"first"
            handled.append(budget.free_bytes)  # while the stream is still open
            yield b"last"

        return StreamingResponse(chunks())

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> Any:
        return error_response(request, exc)

    app.add_middleware(BodyAdmissionMiddleware, budget=budget, min_bytes=MIN_BYTES)
    return app, handled


class Client:
    """A raw ASGI client that counts how much of the body the app pulled; `hold` keeps the last chunk back."""

    def __init__(self, body_chunks: list[bytes], declare: bool = True) -> None:
        self.pending = list(body_chunks)
        total = sum(map(len, body_chunks))
        self.headers = [(b"content-length", str(total).encode())] if declare else [(b"transfer-encoding", b"chunked")]
        self.chunks_read = 0
        self.sent: list[dict[str, Any]] = []
        self.hold = asyncio.Event()
        self.hold.set()

    async def receive(self) -> dict[str, Any]:
        if len(self.pending) == 1:
            await self.hold.wait()
        if not self.pending:
            await asyncio.Event().wait()  # a disconnect listener: nothing more comes
        self.chunks_read += 1
        body = self.pending.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(self.pending)}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def call(self, app: Any, path: str) -> None:
        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b""}
        scope |= {"headers": self.headers, "http_version": "1.1", "scheme": "http", "root_path": ""}
        await app(scope, self.receive, self.send)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers_sent(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    def json(self) -> Any:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_declared_body_waits_for_its_share_before_any_of_it_is_read() -> None:
    async def go() -> None:
        budget = BodyBudget(1000, max_waiting=4, max_wait_s=5)
        app, handled = tiny_app(budget)
        held = await budget.acquire(1000)
        client = Client([b"x" * 400, b"x" * 400])
        request = asyncio.create_task(client.call(app, "/v1/messages"))
        await settle()
        assert client.chunks_read == 0 and budget.waiting == 1 and handled == []
        budget.release(held)
        await request
        assert client.status == 200 and handled == [800] and budget.free_bytes == 1000

    asyncio.run(go())


def test_no_share_in_time_is_a_529_in_the_api_shape_and_the_unread_body_closes_the_connection() -> None:
    async def go() -> None:
        budget = BodyBudget(1000, max_waiting=1, max_wait_s=0.05)
        app, handled = tiny_app(budget)
        await budget.acquire(1000)
        timed_out = Client([b"x" * 500])
        await timed_out.call(app, "/v1/messages")
        assert timed_out.status == 529 and timed_out.chunks_read == 0
        error = timed_out.json()
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        assert "within 0.05 s" in error["error"]["message"]
        assert timed_out.headers_sent[b"connection"] == b"close" and b"retry-after" in timed_out.headers_sent

        waiting = asyncio.create_task(Client([b"x" * 500]).call(app, "/v1/messages"))
        await settle()
        queue_full = Client([b"x" * 500])
        await queue_full.call(app, "/v1/chat/completions")
        assert queue_full.status == 529 and queue_full.chunks_read == 0
        error = queue_full.json()["error"]
        assert error["type"] == "overloaded_error" and error["code"] == "overloaded"
        assert "already waiting" in error["message"]
        assert queue_full.headers_sent[b"connection"] == b"close"
        await waiting
        assert handled == []

    asyncio.run(go())


def test_a_chunked_body_takes_its_share_once_it_has_all_arrived() -> None:
    async def go() -> None:
        budget = BodyBudget(1000, max_waiting=4, max_wait_s=5)
        app, handled = tiny_app(budget)
        held = await budget.acquire(1000)
        client = Client([b"x" * 300] * 3, declare=False)
        request = asyncio.create_task(client.call(app, "/v1/messages"))
        await settle()
        assert client.chunks_read == 3 and budget.waiting == 1 and handled == []  # read, not yet handed on
        budget.release(held)
        await request
        assert client.status == 200 and handled == [900] and budget.free_bytes == 1000

        await budget.acquire(1000)
        budget.max_waiting = 0
        refused = Client([b"x" * 300] * 3, declare=False)
        await refused.call(app, "/v1/messages")
        # All of it was read: the connection can carry the next request
        assert refused.status == 529 and b"connection" not in refused.headers_sent

    asyncio.run(go())


def test_small_bodies_need_no_share() -> None:
    async def go() -> None:
        budget = BodyBudget(1000, max_waiting=0, max_wait_s=5)
        app, handled = tiny_app(budget)
        await budget.acquire(1000)
        for client in (Client([b"x" * (MIN_BYTES - 1)]), Client([b"x" * 50, b"x" * 49], declare=False)):
            await client.call(app, "/v1/messages")
            assert client.status == 200
        assert handled == [MIN_BYTES - 1, MIN_BYTES - 1]

    asyncio.run(go())


def test_the_share_is_held_until_the_request_is_over() -> None:
    async def go() -> None:
        budget = BodyBudget(1000, max_waiting=4, max_wait_s=5)
        app, handled = tiny_app(budget)
        streamed = Client([b"x" * 600])
        await streamed.call(app, "/v1/messages/stream")
        assert streamed.status == 200 and handled == [400]  # held while the stream was open (its writers hold it)
        assert budget.free_bytes == 1000

        failing = Client([b"fail" + b"x" * 600])
        failing.hold.clear()
        request = asyncio.create_task(failing.call(app, "/v1/messages"))
        await settle()
        assert budget.free_bytes == 1000 - 604  # admitted, its last chunk not yet arrived
        failing.hold.set()
        await request
        assert failing.status == 400 and budget.free_bytes == 1000

    asyncio.run(go())


def test_a_route_that_has_built_its_prompt_gives_the_share_back_before_its_answer_ends() -> None:
    """Agents' conversations are megabytes each: a share held through every answer would cap concurrent streams
    at the budget over their size."""

    async def go() -> None:
        budget = BodyBudget(1000, max_waiting=4, max_wait_s=5)
        app, handled = tiny_app(budget)
        streamed = Client([b"x" * 600])
        await streamed.call(app, "/v1/messages/released")
        assert streamed.status == 200 and handled == [1000]  # all of it free while the stream was open
        assert budget.free_bytes == 1000

    asyncio.run(go())


def test_a_large_parsed_body_is_let_go_of_when_the_request_is_over() -> None:
    async def go() -> None:
        budget = BodyBudget(LARGE_BODY_BYTES * 4, max_waiting=4, max_wait_s=5)
        app, handled = tiny_app(budget)
        document = {"blocks": [{"text": "a"}] * (LARGE_BODY_BYTES // 12)}
        raw = json.dumps(document).encode()
        assert len(raw) >= LARGE_BODY_BYTES
        client = Client([raw])
        await client.call(app, "/v1/messages/parsed")
        assert client.status == 200 and client.json() == {"blocks": len(document["blocks"])}
        (body,) = handled
        assert body.blocks == []  # emptied in the large-body thread, a slice at a time
        assert budget.free_bytes == budget.capacity_bytes

    asyncio.run(go())


def test_the_real_app_reads_its_budget_settings() -> None:
    async def go() -> None:
        config = KvServeConfig(body_budget_bytes=LARGE_BODY_BYTES * 2, body_queue_limit=0, body_queue_wait_secs=1)
        app = create_app(config)  # no lifespan: a parsed body is answered 503 (no rank yet)
        text = "x" * LARGE_BODY_BYTES
        body = json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
        stalled = Client([body[:100].encode(), body[100:].encode()])
        stalled.hold.clear()  # admitted, then its last chunk is late: it holds its share
        first = asyncio.create_task(stalled.call(app, "/v1/messages"))
        await settle()
        assert stalled.chunks_read == 1
        refused = Client([body.encode()])
        await refused.call(app, "/v1/messages")
        assert refused.status == 529 and refused.json()["error"]["type"] == "overloaded_error"
        stalled.hold.set()
        await first
        assert stalled.status == 503
        again = Client([body.encode()])
        await again.call(app, "/v1/messages")
        assert again.status == 503  # the share came back

    asyncio.run(go())
