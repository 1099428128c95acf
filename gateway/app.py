"""The FastAPI app: routes wired to the API layers, errors in each API's own shape, health and metrics."""

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
from gateway.anthropic_api import routes as anthropic_routes
from gateway.body_limit import BodyLimitMiddleware
from gateway.openai_api import routes as openai_routes
from gateway.request_flow import ApiError
from gateway.state import GatewayState


def create_app(config: KvServeConfig) -> FastAPI:
    state = GatewayState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        connecting = asyncio.create_task(state.connect())
        try:
            yield
        finally:
            connecting.cancel()
            await state.close()

    app = FastAPI(title="kvserve gateway", lifespan=lifespan)
    app.state.gateway = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.include_router(anthropic_routes.router)
    app.include_router(openai_routes.router)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.model is None:
            return JSONResponse({"status": "waiting for a rank worker"}, status_code=503)
        return JSONResponse({"status": "ready", "model": state.model.name})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, ApiError(400, "invalid_request_error", str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "api_error")
        return error_response(request, ApiError(exc.status_code, kind, str(exc.detail)))

    return app


def error_response(request: Request, error: ApiError) -> JSONResponse:
    """Anthropic shape under /v1/messages (and anything not OpenAI), OpenAI shape under /v1/chat."""
    headers = {"retry-after": str(error.retry_after_s)} if error.retry_after_s else None
    body: dict[str, Any]
    if request.url.path.startswith("/v1/chat/"):
        code = "overloaded" if error.status == 529 else None
        body = {"error": {"message": error.message, "type": error.kind, "param": None, "code": code}}
    else:
        body = {"type": "error", "error": {"type": error.kind, "message": error.message}}
    return JSONResponse(body, status_code=error.status, headers=headers)
