"""The gateway's errors, and the answer each one becomes. One rule decides between a client's error and ours:
what the gateway refuses as sent derives from InvalidRequest and is a 400 with its own message; the errors
below it map to a status of their own; anything else is a 500 whose message names no internal address or
exception text (those go to the log, with the request's id). Each API writes the answer in its own shape
(gateway.http.apis)."""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "internal server error; the gateway logged the details"


class ApiError(Exception):
    """An error to answer with, in the API's own shape: `kind` is the Anthropic error type.

    A plain (mutable) exception: Starlette writes to __traceback__ of exceptions it handles."""

    def __init__(self, status: int, kind: str, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind  # invalid_request_error | authentication_error | overloaded_error | api_error ...
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidRequest(ValueError):
    """A request the gateway cannot serve as sent (HTTP 400 invalid_request_error, its message for the client).
    Every validation error of the gateway's derives from it; a ValueError that does not is a bug (HTTP 500)."""


class InvalidDocument(InvalidRequest):
    """The body is not a JSON document the gateway accepts."""


class InvalidBody(InvalidRequest):
    """The document does not fit the schema; the message lists the first problems."""


class InvalidChat(InvalidRequest):
    """The conversation cannot be served as sent, whatever its API."""


class ChatTemplateError(InvalidRequest):
    """The model's chat template refused the messages (raise_exception) or could not be rendered."""


class ModelNotAvailable(InvalidRequest):
    """The request names a model this gateway does not serve."""


class PromptTooLong(InvalidRequest):
    """The prompt alone does not fit the model's context (before any rank work). `counted`: its tokens were
    counted; False when its size alone showed that it cannot fit, and nothing was tokenized."""

    def __init__(self, message: str, counted: bool = True) -> None:
        super().__init__(message)
        self.counted = counted


class BadRequest(InvalidRequest):
    """The rank refused the request as invalid."""


class BodyTooLarge(Exception):
    """Raised to the app by receive() once the body passes max_request_bytes (the body limit answers 413)."""


class BudgetRefused(Exception):
    """No share of the body budget for this body: the queue is full, or its wait ran out."""


class Overloaded(Exception):
    """Every rank's queue is full (HTTP 529, retry later)."""

    retry_after_s = 5


class Unavailable(Exception):
    """No rank could take the request (HTTP 503 / api_error)."""

    def __init__(self, message: str, refused: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.refused = dict(refused or {})  # rank_id -> address of the ranks that refused it (down, loading, hung)


class StreamBroken(Exception):
    """The rank failed after tokens were sent: the client gets an error event, never a silent end."""


def api_error_for(exc: BaseException, request_id: str = "") -> ApiError:
    """The answer to what serving a request raised."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return ApiError(400, "invalid_request_error", str(exc))
    if isinstance(exc, ClientDisconnect):
        return ApiError(499, "client_disconnected", "client went away")
    if isinstance(exc, BodyTooLarge):  # BodyLimitMiddleware sends the 413 itself; nothing to log here
        return ApiError(413, "request_too_large", "request body is too large")
    if isinstance(exc, Overloaded):
        return ApiError(529, "overloaded_error", f"{exc}; retry later", exc.retry_after_s)
    if isinstance(exc, Unavailable):
        log.warning("no rank worker could take request=%s: %s", request_id or "-", exc)
        return ApiError(503, "api_error", "no rank worker is available; retry later", 5)
    if isinstance(exc, StreamBroken):
        log.warning("generation failed mid-stream for request=%s: %s", request_id or "-", exc)
        return ApiError(500, "api_error", "generation failed mid-stream and no rank could continue it")
    log.error("unexpected error in request=%s", request_id or "-", exc_info=exc)
    return ApiError(500, "api_error", INTERNAL_ERROR_MESSAGE)


def render_error(document: dict[str, Any]) -> bytes:
    # ASCII-escaped: a lone surrogate a client sent (echoed in a message) cannot make the answer unsendable.
    return json.dumps(document, ensure_ascii=True, separators=(",", ":")).encode("ascii")
