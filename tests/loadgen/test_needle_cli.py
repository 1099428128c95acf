"""`kvserve needle`'s wiring and exit codes against an in-memory stand-in of the gateway's three endpoints
(httpx.MockTransport): the real gate against the real stack is in test_needle_e2e.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadgen.needle_cli import main

BLOCK = 16


class FakeGateway:
    """count_tokens by words, a refusal past `context`, and a cache that the second ask of a prompt hits."""

    def __init__(self, context: int | None = None, listed_context: bool = False, warm: str = "same") -> None:
        self.context = context
        self.listed_context = listed_context
        self.warm = warm  # "same" | "different" | "uncached"
        self.seen: set[str] = set()
        self.asked: list[int] = []

    def tokens(self, body: dict[str, Any]) -> int:
        return 30 + len(re.findall(r"\w+|[^\w\s]", body["messages"][0]["content"]))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.headers["x-api-key"] == "test-key"
        if request.method == "GET" and request.url.path == "/v1/models":
            entry: dict[str, Any] = {"id": "fake-model", "type": "model"}
            if self.listed_context:
                entry["max_model_len"] = self.context
            return httpx.Response(200, json={"data": [entry]})
        body = json.loads(request.content)
        assert body["model"] == "fake-model"
        tokens = self.tokens(body)
        if request.url.path == "/v1/messages/count_tokens":
            return httpx.Response(200, json={"input_tokens": tokens})
        assert request.url.path == "/v1/messages" and body["temperature"] == 0
        if self.context is not None and tokens >= self.context:
            message = f"prompt is too long: {tokens} tokens, and this model's context is {self.context} tokens"
            error = {"type": "invalid_request_error", "message": message}
            return httpx.Response(400, json={"type": "error", "error": error})
        prompt = body["messages"][0]["content"]
        code = re.search(r"is (\d{4})\.", prompt)
        assert code is not None
        warm = prompt in self.seen
        self.seen.add(prompt)
        self.asked.append(tokens)
        cached = tokens - tokens % BLOCK if warm and self.warm != "uncached" else 0
        text = f"The code is {code.group(1)}."
        if warm and self.warm == "different":
            text = "The code is unknown."
        usage = {"input_tokens": tokens - cached, "cache_read_input_tokens": cached, "output_tokens": 6}
        content = [{"type": "text", "text": text}]
        return httpx.Response(200, json={"content": content, "usage": usage, "stop_reason": "end_turn"})


def _run(fake: FakeGateway, tmp_path: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "needle.json"
    argv = ["--url", "http://gateway.test", "--api-key", "test-key", "--json", str(out), *flags]
    code = main(argv, transport=httpx.MockTransport(fake))
    return code, json.loads(out.read_text())


def test_identical_cached_answers_pass(tmp_path: Path) -> None:
    fake = FakeGateway()
    code, report = _run(fake, tmp_path, "--lengths", "4096,8k")
    assert code == 0 and report["passed"] and report["failures"] == []
    assert [entry["length"] for entry in report["lengths"]] == [4096, 8192]
    for entry in report["lengths"]:
        assert entry["length"] * 0.97 <= entry["prompt_tokens"] <= entry["length"] - 16
        assert entry["match"] and entry["cold"]["found_needle"]
        assert entry["cold"]["cache_hit"] == 0 and entry["warm"]["cache_hit"] > 0.9
    assert len(fake.asked) == 4  # cold and warm per length, nothing else


def test_a_different_warm_answer_exits_non_zero(tmp_path: Path) -> None:
    code, report = _run(FakeGateway(warm="different"), tmp_path, "--lengths", "4096")
    assert code == 1 and not report["passed"]
    assert report["lengths"][0]["match"] is False
    assert "differs" in report["failures"][0]


def test_a_warm_request_without_cache_exits_non_zero(tmp_path: Path) -> None:
    code, report = _run(FakeGateway(warm="uncached"), tmp_path, "--lengths", "4096")
    assert code == 1 and report["lengths"][0]["match"]
    assert "from cache" in report["failures"][0]


def test_auto_uses_the_listed_context_and_skips_what_does_not_fit(tmp_path: Path) -> None:
    code, report = _run(FakeGateway(context=8192, listed_context=True), tmp_path)
    assert code == 0 and [entry["length"] for entry in report["lengths"]] == [4096, 8192]
    assert report["max_context"] == 8192 and report["skipped"] == []
    code, report = _run(FakeGateway(context=8192, listed_context=True), tmp_path, "--lengths", "4096,16384")
    assert code == 0 and report["skipped"] == [16384]
    # Unknown context: the gateway's refusal skips a length and every longer one asked for.
    code, report = _run(FakeGateway(context=8192), tmp_path, "--lengths", "4096,16384,32768")
    assert code == 0 and report["skipped"] == [16384, 32768] and len(report["lengths"]) == 1


def test_auto_without_a_listed_context_stops_at_the_refusal_and_tests_the_context(tmp_path: Path) -> None:
    fake = FakeGateway(context=10_000)
    code, report = _run(fake, tmp_path)
    assert code == 0
    assert [entry["length"] for entry in report["lengths"]] == [4096, 8192, 10_000]
    assert report["max_context"] == 10_000
    assert report["skipped"] == [16384]  # the refused guess; longer guesses were never tried
    assert len(fake.asked) == 6  # the refused 16K prompt never reached generation


def test_only_skipped_lengths_fail(tmp_path: Path) -> None:
    code, report = _run(FakeGateway(context=8192), tmp_path, "--lengths", "16k", "--max-context", "8192")
    assert code == 1 and report["skipped"] == [16384]
    assert report["failures"] == ["no length was tested (skipped: 16384)"]


def test_an_unreachable_gateway_exits_2(tmp_path: Path) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    argv = ["--url", "http://gateway.test", "--json", str(tmp_path / "x.json")]
    assert main(argv, transport=httpx.MockTransport(refuse)) == 2
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("flags", [["--lengths", "four"], ["--depth", "2"], ["--max-tokens", "0"]])
def test_bad_flags_exit_2(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
