"""What every API route does first: find the gateway state, authenticate, parse the body leniently into
its schema (errors as 400 in the API's shape, never FastAPI's 422), and check the model is allowed."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from gateway.auth import AuthError, KeyEntry
from gateway.body_parse import parse_request_body
from gateway.generation import Generation
from gateway.request_flow import ApiError
from gateway.state import GatewayState

Body = TypeVar("Body", bound=BaseModel)


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway


def authenticate(request: Request) -> KeyEntry | None:
    """None in open-local mode; otherwise the caller's key, or 401."""
    keys = gateway_state(request).keys
    if keys is None:
        return None
    try:
        return keys.authenticate(request.headers.get("x-api-key"), request.headers.get("authorization"))
    except AuthError as exc:
        raise ApiError(401, "authentication_error", str(exc)) from exc


def check_model_allowed(key: KeyEntry | None, model: str) -> None:
    if key is not None and not key.allows(model):
        raise ApiError(403, "permission_error", f"this API key may not use model {model!r}")


async def parse_body(request: Request, schema: type[Body]) -> Body:
    """The body in its schema, parsed off the event loop by size; ApiError 400 for what cannot be accepted."""
    return await parse_request_body(request, schema)


def not_ready() -> ApiError:
    return ApiError(503, "api_error", "the gateway is still waiting for a rank worker", retry_after_s=2)


def ready_generation(request: Request) -> Generation:
    generation = gateway_state(request).generation
    if generation is None:
        raise not_ready()
    return generation
