"""A request body read, parsed and validated without holding up the event loop, its work bounded.

Small bodies are parsed in place; larger ones in a worker thread. The work for a large body (from
LARGE_BODY_BYTES: parsing, converting, rendering) runs in one thread of its own, one request at a time,
with the cyclic garbage collector paused: that work is GIL-bound, so two at once would be no faster and
hold twice the memory, and the millions of objects a large document makes would otherwise set off full
collections that hold the GIL for seconds (2.6 s without a break, measured), stalling every stream. After
a large body the memory it took is given back to the system (the callers ask for it when the request is
over: memory_return.schedule_memory_return)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from gateway.body_validation import InvalidBody, validate_body
from gateway.json_document import InvalidDocument, parse_document
from gateway.request_flow import ApiError

Body = TypeVar("Body", bound=BaseModel)
Result = TypeVar("Result")

INLINE_BODY_BYTES = 16 * 1024  # parsed on the loop: less work than a hand-off to a thread
LARGE_BODY_BYTES = 1024 * 1024
_large_bodies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="large-body")


def body_from_bytes(raw: bytes | bytearray, schema: type[Body]) -> Body:
    """The validated body; ApiError 400 invalid_request_error for anything the gateway cannot accept."""
    try:
        document = parse_document(raw)
        if not isinstance(document, dict):
            raise InvalidDocument("request body must be a JSON object")
        return validate_body(schema, document)
    except (InvalidDocument, InvalidBody) as exc:
        raise ApiError(400, "invalid_request_error", str(exc)) from None  # no traceback keeping the document


async def parse_request_body(request: Request, schema: type[Body]) -> Body:
    """Read the body (not kept on the request: a stream would hold it to its end) and parse it by size."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
    request.state.body_bytes = len(raw)
    if len(raw) < INLINE_BODY_BYTES:
        return body_from_bytes(raw, schema)
    return await work_for_body(request, body_from_bytes, raw, schema)


async def work_for_body(request: Request, work: Callable[..., Result], *args: Any) -> Result:
    """`work(*args)` off the event loop: for a large body in the large-body thread, else in any worker."""
    if not large_body(request):
        return await asyncio.to_thread(work, *args)
    return await asyncio.get_running_loop().run_in_executor(_large_bodies, _without_gc, work, args)


def large_body(request: Request) -> bool:
    """Whether this request's body was large (then its end should give memory back too)."""
    return getattr(request.state, "body_bytes", 0) >= LARGE_BODY_BYTES


def _without_gc(work: Callable[..., Result], args: tuple[Any, ...]) -> Result:
    # Only the single large-body thread pauses the collector, so pauses never overlap. What the work made
    # is then frozen (left out of collections; memory_return unfreezes it once the request is over): the
    # first collection after the pause would otherwise walk every object made during it, as long a stall.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return work(*args)
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
