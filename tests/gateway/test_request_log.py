"""The per-request log line: every field, derived values, one line whatever the client sends, and prompt text
only with log_prompts."""

from __future__ import annotations

import json
import logging
import re

import pytest

from gateway.observability.request_log import RequestRecord, format_prompt_line, format_request_line, log_request

PAIR = re.compile(r'(?P<key>\w+)=(?P<value>"(?:[^"\\]|\\.)*"|[^\s"]+) ?')
SECRET_PROMPT = "please refactor my private module named zebra_quartz"


def full_record(**changes: object) -> RequestRecord:
    record = RequestRecord(
        request_id="req_01",
        api="anthropic",
        model="smollm2",
        session="0b7c1e4e-5d1f-4c55-a0c6-2a8c5a1b9f00",
        status=200,
        prompt_tokens=12000,
        cached_tokens=9000,
        l1_cached_tokens=2000,
        output_tokens=201,
        rank="rank-0",
        rank_switches=1,
        prepare_s=0.0311,
        tokenize_s=0.0204,
        queue_wait_s=0.0042,
        ttft_s=0.350,
        decode_s=4.0,
        finish_reason="tool_use",
        prompt_text=SECRET_PROMPT,
    )
    for key, value in changes.items():
        setattr(record, key, value)
    return record


def parse(line: str) -> dict[str, str]:
    """A logfmt reader whose quoted values are JSON strings, as the log writes them; it must consume the line."""
    assert line.split(" ", 1)[0] in ("request", "prompt_debug")
    fields: dict[str, str] = {}
    rest = line.split(" ", 1)[1]
    while rest:
        match = PAIR.match(rest)
        assert match, rest
        key, value = match["key"], match["value"]
        fields[key] = json.loads(value) if value.startswith('"') else value
        rest = rest[match.end() :]
    return fields


def test_every_field_is_in_the_line() -> None:
    fields = parse(format_request_line(full_record()))
    assert fields == {
        "id": "req_01",
        "session": "0b7c1e4e-5d1f-4c55-a0c6-2a8c5a1b9f00",
        "api": "anthropic",
        "model": "smollm2",
        "status": "200",
        "prompt_tokens": "12000",
        "cached_tokens": "9000",
        "l0_cached": "7000",
        "l1_cached": "2000",
        "hit_pct": "75.0",
        "prepare_ms": "31.1",
        "tokenize_ms": "20.4",
        "queue_ms": "4.2",
        "ttft_ms": "350.0",
        "output_tokens": "201",
        "tok_s": "50.0",  # 200 tokens after the first, in 4 s
        "finish": "tool_use",
        "rank": "rank-0",
        "rank_switches": "1",
    }


def test_unknown_values_are_dashes_and_errors_are_named() -> None:
    record = RequestRecord(request_id="req_02", api="openai", model="m", status=529, error_type="overloaded_error")
    fields = parse(format_request_line(record))
    assert fields["status"] == "529" and fields["error"] == "overloaded_error"
    for key in ("session", "hit_pct", "prepare_ms", "tokenize_ms", "queue_ms", "ttft_ms", "tok_s", "finish"):
        assert fields[key] == "-", key
    assert fields["prompt_tokens"] == "0" and fields["output_tokens"] == "0"


@pytest.mark.parametrize(
    ("output_tokens", "decode_s", "expected"), [(1, 0.0, None), (2, 0.0, None), (11, 0.5, 20.0), (5, None, None)]
)
def test_tokens_per_second(output_tokens: int, decode_s: float | None, expected: float | None) -> None:
    assert full_record(output_tokens=output_tokens, decode_s=decode_s).tokens_per_s == expected


def test_client_strings_cannot_break_the_line() -> None:
    hostile = 'm" status=200\nrequest id=forged\u2028x\x85y'
    line = format_request_line(full_record(model=hostile, session="a b"))
    assert len(line.splitlines()) == 1
    fields = parse(line)
    assert fields["status"] == "200" and fields["id"] == "req_01"
    assert fields["model"] == hostile
    assert fields["session"] == "a b"
    assert len(format_request_line(full_record(model="x" * 10_000))) < 1000


def test_no_prompt_text_by_default(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvserve.gateway"):
        log_request(full_record())
    assert len(caplog.records) == 1
    assert caplog.records[0].name == "kvserve.gateway.requests"
    assert "zebra_quartz" not in caplog.text
    assert "id=req_01" in caplog.text


def test_log_prompts_adds_a_marked_separate_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvserve.gateway"):
        log_request(full_record(), log_prompts=True)
    request, prompt = caplog.records
    assert "zebra_quartz" not in request.getMessage()
    assert prompt.name == "kvserve.gateway.prompts"
    fields = parse(prompt.getMessage())
    assert prompt.getMessage().startswith("prompt_debug ")
    assert fields["log_prompts"] == "true" and fields["id"] == "req_01" and fields["prompt"] == SECRET_PROMPT


def test_long_prompts_keep_head_and_tail() -> None:
    prompt = "SYSTEM-START " + "x" * 50_000 + "\n latest user turn"
    line = format_prompt_line(full_record(prompt_text=prompt), max_chars=200)
    assert len(line.splitlines()) == 1 and len(line) < 400
    fields = parse(line)
    assert fields["chars"] == str(len(prompt)) and fields["cut_chars"] == str(len(prompt) - 200)
    assert fields["prompt"].startswith("SYSTEM-START ") and fields["prompt"].endswith("\n latest user turn")


def test_a_lone_surrogate_from_a_client_cannot_lose_the_line() -> None:
    line = format_request_line(full_record(model="claude\ud800", session="s\udfff"))
    line.encode("utf-8")  # what the log handler does; a lone surrogate would raise here
    assert parse(line)["model"] == "claude\ud800" and parse(line)["session"] == "s\udfff"
