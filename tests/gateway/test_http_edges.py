"""What the gateway answers without a key, and how, in-process through the real app: the API description only
in open loopback mode, /metrics behind a key with the metrics scope unless metrics_public, a trailing slash
answered directly (never a redirect built from the Host header), a 405 with its Allow header."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from contracts.config import KvServeConfig
from gateway.http.app import create_app
from gateway.http.auth import create_key

DOCS = ("/docs", "/redoc", "/openapi.json")


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    return tmp_path / "keys.json"


def client(**settings: object) -> TestClient:
    return TestClient(create_app(KvServeConfig(**settings)))  # no lifespan: no rank is needed for these paths


def test_api_description_only_in_open_loopback_mode(keys_file: Path) -> None:
    secret = create_key(keys_file, "ops", ["*"])
    open_local = client()
    for path in DOCS:
        assert open_local.get(path).status_code == 200, path
    with_keys = client(api_keys_file=str(keys_file))
    for path in DOCS:
        assert with_keys.get(path).status_code == 404, path
        assert with_keys.get(path, headers={"x-api-key": secret}).status_code == 404, path


def test_metrics_need_a_key_with_the_metrics_scope_unless_configured_public(keys_file: Path) -> None:
    secret = create_key(keys_file, "prometheus", [], ["metrics"])
    every_model = create_key(keys_file, "inference", ["*"])
    private = client(api_keys_file=str(keys_file))
    refused = private.get("/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert private.get("/metrics", headers={"authorization": f"Bearer {secret}"}).status_code == 200
    forbidden = private.get("/metrics", headers={"x-api-key": every_model})  # '*' is every model, not every scope
    assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
    assert "metrics scope" in forbidden.json()["error"]["message"]
    public = client(api_keys_file=str(keys_file), metrics_public=True)
    assert public.get("/metrics").status_code == 200
    assert client().get("/metrics").status_code == 200  # open loopback mode: open like everything else
    assert private.get("/health").status_code == 200  # probes need no key


def test_a_trailing_slash_is_answered_not_redirected() -> None:
    app = client()
    for path in ("/health/", "/health//", "/metrics/"):
        response = app.get(path, headers={"host": "attacker.example"}, follow_redirects=False)
        assert response.status_code == 200 and "location" not in response.headers, path
    assert app.get("/", follow_redirects=False).status_code == 404


def test_405_names_the_allowed_methods() -> None:
    app = client()
    anthropic = app.get("/v1/messages")
    assert anthropic.status_code == 405 and anthropic.headers["allow"] == "POST"
    assert anthropic.json()["error"]["type"] == "invalid_request_error"
    openai = app.put("/v1/chat/completions/")
    assert openai.status_code == 405 and openai.headers["allow"] == "POST"
    assert openai.json()["error"]["type"] == "invalid_request_error" and "param" in openai.json()["error"]
    assert app.post("/health").headers["allow"] == "GET"
