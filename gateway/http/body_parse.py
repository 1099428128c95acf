"""A request body read, parsed and validated without holding up the event loop, its work bounded.

Small bodies are parsed in place; larger ones in a worker thread. The work for a large body (from
LARGE_BODY_BYTES: parsing, converting, rendering) runs in one thread of its own, one request at a time,
with the cyclic garbage collector paused: that work is GIL-bound, so two at once would be no faster and
hold twice the memory, and the millions of objects a large document makes would otherwise set off full
collections that hold the GIL for seconds (2.6 s without a break, measured). How many bodies are held at
once is bounded before they are read (gateway.http.body_admission). The parsed body stays in the request's state
until the chat route has built its prompt (body_admission.release_body) or the request is over; then
let_go_of_body frees a large one in that thread, a slice at a time, and gives its memory back to the system
(gateway.http.memory_return), before the body's share of the budget is given back."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from gateway.http.body_validation import empty_in_slices, validate_body
from gateway.http.errors import ApiError, InvalidBody, InvalidDocument
from gateway.http.json_document import parse_document
from gateway.http.memory_return import return_memory

Body = TypeVar("Body", bound=BaseModel)
Result = TypeVar("Result")

INLINE_BODY_BYTES = 16 * 1024  # parsed on the loop: less work than a hand-off to a thread
LARGE_BODY_BYTES = 1024 * 1024
_large_bodies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="large-body")
PARSED_BODY = "parsed_body"  # the request state's key for the body, kept there for let_go_of_body


def body_from_bytes(raw: bytes | bytearray, schema: type[Body]) -> Body:
    """The validated body; ApiError 400 invalid_request_error for anything the gateway cannot accept."""
    try:
        return _validated(raw, schema)
    except (InvalidDocument, InvalidBody) as exc:
        problem = str(exc)
    # Raised out here, with no context: the problem's traceback holds the document, to be freed in this thread
    raise ApiError(400, "invalid_request_error", problem)


def _validated(raw: bytes | bytearray, schema: type[Body]) -> Body:
    document = parse_document(raw)
    if not isinstance(document, dict):
        raise InvalidDocument("request body must be a JSON object")
    return validate_body(schema, document)


async def parse_request_body(request: Request, schema: type[Body]) -> Body:
    """Read the body (its bytes not kept on the request: a stream would hold them to its end) and parse it by
    size; the parsed body is kept in the request's state for let_go_of_body."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
    request.state.body_bytes = len(raw)
    if len(raw) < INLINE_BODY_BYTES:
        body = body_from_bytes(raw, schema)
    else:
        body = await work_for_body(request, body_from_bytes, raw, schema)
    setattr(request.state, PARSED_BODY, body)
    return body


async def work_for_body(request: Request, work: Callable[..., Result], *args: Any) -> Result:
    """`work(*args)` off the event loop: for a large body in the large-body thread, else in any worker."""
    if not large_body(request):
        return await asyncio.to_thread(work, *args)
    return await asyncio.get_running_loop().run_in_executor(_large_bodies, _without_gc, work, args)


def large_body(request: Request) -> bool:
    """Whether this request's body was large (its work then runs in the large-body thread)."""
    return getattr(request.state, "body_bytes", 0) >= LARGE_BODY_BYTES


async def let_go_of_body(state: dict[str, Any]) -> None:
    """Once the body is needed no more (`state`: its scope's state), free what parse_request_body kept there; after
    a large one (parsed or not), in the large-body thread: the body a slice at a time, then the memory given
    back to the system."""
    held = [state.pop(PARSED_BODY, None)]
    if state.get("body_bytes", 0) >= LARGE_BODY_BYTES:
        await asyncio.get_running_loop().run_in_executor(_large_bodies, _free_large_body, held)


def _free_large_body(held: list[BaseModel | None]) -> None:
    if held[0] is not None:
        empty_in_slices(held[0])
    held.clear()  # the last reference: what is left of the body is freed here, not on the event loop
    return_memory()


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
