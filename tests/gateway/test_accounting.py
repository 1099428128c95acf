"""The end of a request: a request cut by a failure or a disconnect is logged with what it streamed and what
the rank found cached; inside a request the line waits for the response and carries the status sent."""

from __future__ import annotations

import logging

import pytest

from contracts.config import KvServeConfig
from gateway.http.errors import ApiError
from gateway.observability.accounting import pending_record, record_end, record_failure
from gateway.observability.request_log import RequestRecord
from gateway.prompt.chat import ChatRequest
from gateway.ranks.generation import OpenGeneration, PreparedRequest
from gateway.ranks.rank_choice import RankChoice
from gateway.ranks.rank_client import RankStream
from gateway.state import GatewayState


@pytest.fixture
def state() -> GatewayState:
    return GatewayState(KvServeConfig())


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvserve.gateway.requests"]


def cut_generation(delivered: int, switched: bool) -> OpenGeneration:
    """A generation whose first stream served the prompt (cache use from its first chunk) and, if `switched`,
    went on on a second rank before it was cut."""
    prepared = PreparedRequest(ChatRequest(messages=[]), "prompt", list(range(100)), max_tokens=50, request_id="msg_x")
    # The rank's counts, as in its TokenChunk: 64 tokens from L0, and 32 after them restored from L1.
    first = RankStream("127.0.0.1:1", call=None, tokens_sent=3, l0_cached_tokens=64, l1_cached_tokens=32)  # type: ignore[arg-type]
    first.queue_wait_s = 0.25
    opened = OpenGeneration(None, prepared, first, RankChoice("rank-0", "127.0.0.1:1"))  # type: ignore[arg-type]
    opened.cache_stream = first
    if switched:
        opened.stream = RankStream("127.0.0.1:2", call=None, tokens_sent=2, l0_cached_tokens=99)  # type: ignore[arg-type]
        opened.choice, opened.rank_switches = RankChoice("rank-1", "127.0.0.1:2"), 1
    opened.delivered = list(range(delivered))
    return opened


@pytest.mark.parametrize(
    ("failure", "switched"),
    [(ApiError(499, "client_disconnected", "client went away"), False), (ApiError(500, "api_error", "x"), True)],
    ids=["abandoned", "failed-after-a-switch"],
)
def test_a_cut_request_logs_its_tokens_and_cache(
    state: GatewayState, caplog: pytest.LogCaptureFixture, failure: ApiError, switched: bool
) -> None:
    caplog.set_level(logging.INFO)
    record = RequestRecord(request_id="req_cut", api="anthropic", prompt_tokens=100)
    record_end(state, record, None, failure, "", cut_generation(5, switched))
    (line,) = lines(caplog)
    assert f" status={failure.status} " in line and "output_tokens=5 " in line
    assert " cached_tokens=96 l0_cached=64 l1_cached=32 " in line  # the stream that served the prompt, both tiers
    assert f" rank={'rank-1' if switched else 'rank-0'} " in line and " queue_ms=250.0 " in line
    assert (" finish=cancelled " in line) == (failure.status == 499)
    metrics = state.metrics.render()[0].decode()
    assert 'kvserve_gateway_output_tokens_total{api="anthropic"} 5.0' in metrics


def test_inside_a_request_the_line_waits_for_the_status_sent(
    state: GatewayState, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with pending_record() as pending:
        record_failure(
            state, RequestRecord(request_id="req_a", api="openai"), ApiError(400, "invalid_request_error", "x")
        )
        assert lines(caplog) == []
        pending.settle(413)  # the body limit answered instead
    (line,) = lines(caplog)
    assert " status=413 " in line and line.endswith("error=request_too_large")
    with pending_record() as pending:
        record_failure(state, RequestRecord(request_id="req_b", api="openai"), ApiError(404, "not_found_error", "x"))
        pending.settle(404)
    assert " status=404 " in lines(caplog)[1] and lines(caplog)[1].endswith("error=not_found_error")
