"""The APIs the app serves, each as it registers itself (gateway/api/): its routes, the label its requests are
counted and logged under, and the shape of its errors. An error takes the shape of the API whose route raised
it; one raised before any route ran (a 404, the body limit's 413, the error boundary's 500) that of the API
whose path prefix the path starts with; a path of no API that of the first API registered."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi.routing import APIRoute
from starlette.types import Scope

from gateway.http.errors import ApiError


@dataclass(frozen=True)
class RegisteredApi:
    name: str  # the label of its requests in the metrics and the request log
    router: APIRouter  # its paths
    path_prefix: str  # a path that starts with it is this API's, before any route runs
    chat_path: str  # its generation endpoint: a request there counts as in flight until its response is over
    error_document: Callable[[ApiError], dict[str, Any]]
    too_large_document: Callable[[str], dict[str, Any]]  # the body limit's 413 (message -> document)


class Apis:
    def __init__(self, *apis: RegisteredApi) -> None:
        self._apis = apis
        # Starlette names the matched route's endpoint in the scope: the same function the API registered.
        routes = [(route, api) for api in apis for route in api.router.routes]
        self._by_endpoint = {route.endpoint: api for route, api in routes if isinstance(route, APIRoute)}

    def __iter__(self) -> Iterator[RegisteredApi]:
        return iter(self._apis)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(api.name for api in self._apis)

    def for_scope(self, scope: Scope) -> RegisteredApi:
        """The API of the request: its matched route's, else its path's."""
        return self._by_endpoint.get(scope.get("endpoint")) or self.for_path(scope.get("path", ""))

    def for_path(self, path: str) -> RegisteredApi:
        return next((api for api in self._apis if path.startswith(api.path_prefix)), self._apis[0])

    def chat_api(self, path: str) -> RegisteredApi | None:
        """The API whose generation endpoint `path` is (a trailing slash allowed), None for any other path."""
        path = path.rstrip("/") or "/"
        return next((api for api in self._apis if api.chat_path == path), None)
