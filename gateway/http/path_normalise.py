"""Routes answer with or without a trailing slash (a pure ASGI middleware that drops it before routing).
Starlette would instead redirect (307) to a Location built from the Host header, which the client chooses:
an open redirect, and one more round trip for clients that follow it."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class TrailingSlashMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = dict(scope)
            scope["path"] = path.rstrip("/") or "/"
            raw_path = scope.get("raw_path")
            if raw_path:
                scope["raw_path"] = raw_path.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)
