"""Internal errors are not client errors: whatever escapes a route is a 500 `api_error` in the API's own shape
that names no internal address or exception text, its traceback logged once; the request log carries the
status that was sent; only the gateway's own validation errors become 4xx. In-process, through the real app
(no rank needed: the routes under test are added to it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from starlette.requests import ClientDisconnect

from contracts.config import KvServeConfig
from gateway.api.openai.convert import to_chat
from gateway.api.openai.schema import ChatCompletionRequest
from gateway.http.app import create_app
from gateway.http.errors import ApiError, PromptTooLong, StreamBroken, Unavailable, api_error_for
from gateway.observability.accounting import record_failure
from gateway.observability.request_log import RequestRecord

INTERNAL = "dial 10.20.30.40:50151 failed: secret-detail"


@pytest.fixture
def app() -> FastAPI:
    app = create_app(KvServeConfig())

    async def explode() -> None:
        raise RuntimeError(INTERNAL)

    async def refuse_then_explode(request: Request) -> None:
        # the app accounted a 400, then failed while answering it
        record = RequestRecord(request_id="req_boom", api="anthropic")
        record_failure(request.app.state.gateway, record, ApiError(400, "invalid_request_error", "bad"))
        raise RuntimeError(INTERNAL)

    app.add_api_route("/v1/messages/explode", explode, methods=["POST"])
    app.add_api_route("/v1/chat/explode", explode, methods=["POST"])
    app.add_api_route("/v1/messages/refuse-then-explode", refuse_then_explode, methods=["POST"])
    return app


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.exc_info and isinstance(record.exc_info[1], RuntimeError)]


@pytest.mark.parametrize(("path", "shape"), [("/v1/messages/explode", "anthropic"), ("/v1/chat/explode", "openai")])
def test_an_unexpected_exception_is_a_500_in_the_api_shape_without_internal_text(
    app: FastAPI, caplog: pytest.LogCaptureFixture, path: str, shape: str
) -> None:
    caplog.set_level(logging.INFO)
    client = TestClient(app)  # raises what escapes the app: nothing must (no lifespan: no rank is needed)
    response = client.post(path, json={})
    assert client.get("/health").status_code == 200  # and the app goes on serving
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
    else:
        assert body["error"]["type"] == "api_error" and body["error"]["param"] is None
    for leaked in ("10.20.30.40", "secret-detail", "RuntimeError"):
        assert leaked not in response.text
    assert len(tracebacks(caplog)) == 1


def test_the_request_log_has_the_status_that_was_sent(app: FastAPI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvserve.gateway.requests")
    client = TestClient(app)
    response = client.post("/v1/messages/refuse-then-explode", json={})
    metrics = client.get("/metrics").text
    assert response.status_code == 500
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.gateway.requests"]
    assert len(lines) == 1 and "id=req_boom" in lines[0]
    assert " status=500 " in lines[0] and lines[0].endswith("error=api_error")
    assert 'kvserve_gateway_requests_total{api="anthropic",status="500"} 1.0' in metrics
    assert 'status="400"' not in metrics


def test_only_the_gateways_own_validation_errors_are_4xx(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    assert api_error_for(PromptTooLong("prompt is too long: 9 tokens")).status == 400
    with pytest.raises(ValueError) as converter_refusal:  # how our converter refuses a request
        to_chat(ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "x", "content": "hi"}]}))
    refusal = api_error_for(converter_refusal.value)
    assert refusal.status == 400 and "unknown role" in refusal.message
    assert not tracebacks(caplog)

    with pytest.raises(ValueError) as library_error:
        int("10.20.30.40")  # a ValueError that is not ours: a bug, not a bad request
    with pytest.raises(UnicodeEncodeError) as encode_error:
        "\ud800".encode()
    for exc in (library_error.value, encode_error.value, KeyError("10.20.30.40")):
        error = api_error_for(exc)
        assert (error.status, error.kind) == (500, "api_error")
        assert "10.20.30.40" not in error.message and type(exc).__name__ not in error.message
    assert len([r for r in caplog.records if r.exc_info]) == 3  # each logged with its traceback


def test_rank_failures_name_no_internal_address(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    unavailable = api_error_for(Unavailable("rank 127.0.0.1:50151: UNAVAILABLE: failed to connect"))
    broken = api_error_for(StreamBroken("rank 127.0.0.1:50152 failed after 3 tokens: UNAVAILABLE: reset"))
    assert (unavailable.status, broken.status) == (503, 500)
    for error in (unavailable, broken):
        assert "127.0.0.1" not in error.message and "UNAVAILABLE" not in error.message
    assert "127.0.0.1:50151" in caplog.text and "127.0.0.1:50152" in caplog.text  # the operator still learns


def test_a_client_disconnect_is_a_cancellation_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    error = api_error_for(ClientDisconnect())
    assert (error.status, error.kind) == (499, "client_disconnected")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_streamed_body_over_the_limit_is_logged_as_the_413_it_got(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    client = TestClient(create_app(KvServeConfig(max_request_bytes=1000)))

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is found while reading
        yield from [b"x" * 500] * 4

    response = client.post("/v1/messages", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvserve.gateway.requests"]
    assert " status=413 " in line and line.endswith("error=request_too_large")
    assert not [r for r in caplog.records if r.exc_info]
