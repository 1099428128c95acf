"""The FastAPI app: the APIs' routes behind the hardening middlewares, errors in each API's own shape, health
and metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from contracts.config import KvServeConfig
from gateway.api.anthropic import routes as anthropic
from gateway.api.openai import routes as openai
from gateway.flow import authenticate, check_metrics_allowed
from gateway.http.apis import Apis
from gateway.http.body_admission import BodyAdmissionMiddleware
from gateway.http.body_budget import BodyBudget
from gateway.http.body_deadline import BodyDeadlineMiddleware
from gateway.http.body_limit import BodyLimitMiddleware
from gateway.http.error_boundary import ErrorBoundary
from gateway.http.errors import ApiError, render_error
from gateway.http.path_normalise import TrailingSlashMiddleware
from gateway.state import GatewayState

MODEL_INFO_PATH = "/kvserve/model-info"  # the ranks' ModelInfoResponse, serialized (read by gateway/epp/)

# Each API brings its routes, its metrics label and its error shape (the first one's answers for paths of none).
APIS = Apis(anthropic.API, openai.API)
# Answers after which the connection cannot carry another request: the body was not (all) read.
CLOSE_AFTER = (408, 413)


def create_app(config: KvServeConfig) -> FastAPI:
    state = GatewayState(config, APIS.names)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        connecting = asyncio.create_task(state.connect())
        try:
            yield
        finally:
            connecting.cancel()
            await state.close()

    # The API description only where anyone may call the API anyway (open loopback mode).
    docs = state.keys is None
    app = FastAPI(
        title="kvserve gateway",
        lifespan=lifespan,
        redirect_slashes=False,  # TrailingSlashMiddleware answers such paths directly
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.gateway = state
    # Added innermost first: ErrorBoundary ends up outermost, so it sees what every other layer sent.
    budget = BodyBudget(config.body_budget_bytes, config.body_queue_limit, config.body_queue_wait_secs)
    app.add_middleware(BodyAdmissionMiddleware, budget=budget)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes, apis=APIS)
    app.add_middleware(BodyDeadlineMiddleware, timeout_s=config.request_read_timeout_secs)
    app.add_middleware(TrailingSlashMiddleware)
    app.add_middleware(ErrorBoundary, metrics=state.metrics, apis=APIS)
    for api in APIS:
        app.include_router(api.router)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.model is None:
            return JSONResponse({"status": "waiting for a rank worker"}, status_code=503)
        return JSONResponse({"status": "ready", "model": state.model.name})

    @app.get(MODEL_INFO_PATH)
    async def model_info(request: Request) -> Response:
        # The ranks' model info, for the fleet's EPP (gateway/epp/): the tokenizer, template and block hashing
        # that let it hash a prompt's blocks as this gateway does. Guarded as /metrics is.
        if not config.metrics_public:
            check_metrics_allowed(authenticate(request))
        if state.model is None:
            return JSONResponse({"status": "waiting for a rank worker"}, status_code=503)
        return Response(state.model.info.SerializeToString(), media_type="application/x-protobuf")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not config.metrics_public:
            check_metrics_allowed(authenticate(request))  # open in open loopback mode; with keys, the metrics scope
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(request, ApiError(400, "invalid_request_error", str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "api_error")
        # exc.headers carries the 405's Allow
        return error_response(request, ApiError(exc.status_code, kind, str(exc.detail)), exc.headers)

    return app


def error_response(request: Request, error: ApiError, extra_headers: dict[str, str] | None = None) -> Response:
    """The error in the shape of the request's API."""
    headers: dict[str, Any] = dict(extra_headers or {})
    if error.retry_after_s:
        headers["retry-after"] = str(error.retry_after_s)
    if error.status in CLOSE_AFTER:
        headers["connection"] = "close"
    body = render_error(APIS.for_scope(request.scope).error_document(error))
    return Response(body, status_code=error.status, headers=headers, media_type="application/json")
