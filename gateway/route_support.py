"""What every API route does first: find the gateway state, authenticate, parse the body leniently into
its schema (errors as 400 in the API's shape, never FastAPI's 422), and check the key's scope (a model, /metrics)."""

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


def check_model_allowed(request: Request, key: KeyEntry | None, model: str) -> None:
    """403 unless the key may use `model`, by any of the served model's names (an alias and the served name are
    one scope); 503 while no rank has said which names those are and the name alone does not decide."""
    if key is None:
        return
    served = gateway_state(request).model
    if key.allows(model, served.names if served is not None else ()):
        return
    if served is None:
        raise not_ready()
    raise ApiError(403, "permission_error", f"this API key may not use model {model!r}")


def check_metrics_allowed(key: KeyEntry | None) -> None:
    """/metrics is a scope of its own: a key for the models does not show the whole gateway's traffic."""
    if key is not None and not key.reads_metrics:
        raise ApiError(
            403,
            "permission_error",
            "this API key may not read /metrics: it needs the metrics scope "
            "(`kvserve keys create --name NAME --metrics`)",
        )


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
