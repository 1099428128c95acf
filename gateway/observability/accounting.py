"""At the end of every request, whatever its API: the log line and the metrics.

Inside the app the line is written once the response has gone out (ErrorBoundary settles it), so that its
status is the one the client got: an error answer that itself failed to send, a 413 the body limit sent
instead, a 408 for a body that never came. Called outside a request (tests), it is written at once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from gateway.http.errors import ApiError
from gateway.observability.request_log import RequestRecord, log_request
from gateway.ranks.generation import Finish
from gateway.state import GatewayState

if TYPE_CHECKING:
    from gateway.ranks.generation import OpenGeneration

CANCELLED = "client_disconnected"  # the error type of a request whose client went away
# What an answer of this status is, when the app's record says otherwise (the answer came from elsewhere).
ERROR_TYPE_OF_STATUS = {408: "timeout_error", 413: "request_too_large", 499: CANCELLED}


class PendingRecord:
    """The record of the request being served, held until its response is out."""

    def __init__(self) -> None:
        self.state: GatewayState | None = None
        self.record: RequestRecord | None = None
        self.request_id = ""  # once the route named the request: its response carries it in id_header
        self.id_header = ""

    def settle(self, sent_status: int | None, sent_error_type: str = "") -> None:
        """Log and count the request with the status that was sent (None: nothing could be sent)."""
        state, record = self.state, self.record
        if state is None or record is None:
            return
        self.record = None
        # A stream that failed after its 200 keeps its error status: the client got an error event.
        if sent_status is not None and sent_status != 200 and sent_status != record.status:
            record.status = sent_status
            record.error_type = sent_error_type or ERROR_TYPE_OF_STATUS.get(sent_status, "api_error")
            if record.error_type == CANCELLED:
                record.finish_reason = "cancelled"
        elif sent_status is None and record.status == 200:
            record.status, record.error_type, record.finish_reason = 499, CANCELLED, "cancelled"
        if record.error_type:
            state.metrics.observe_error(record.error_type)
        state.metrics.observe_request(
            record.api,
            record.status,
            ttft_s=record.ttft_s,
            prompt_tokens=record.prompt_tokens,
            cached_tokens={"l0": record.cached_tokens - record.l1_cached_tokens, "l1": record.l1_cached_tokens},
            output_tokens=record.output_tokens,
        )
        log_request(record, log_prompts=state.config.log_prompts)
        state.report_finished(record)  # the router's per-session view; in the background, never fails here


_pending: ContextVar[PendingRecord | None] = ContextVar("kvserve_pending_record", default=None)


@contextmanager
def pending_record() -> Iterator[PendingRecord]:
    """Within the block (one request), record_failure and record_end hand their record to the yielded
    PendingRecord instead of logging it; the caller settles it once the response is out."""
    pending = PendingRecord()
    token = _pending.set(pending)
    try:
        yield pending
    finally:
        _pending.reset(token)


def name_request(request_id: str, header: str) -> None:
    """Within pending_record(): the response of the request being served, whatever it is, carries
    `header: request_id`, so a client can name the request even when it was refused."""
    pending = _pending.get()
    if pending is not None:
        pending.request_id, pending.id_header = request_id, header


def record_failure(state: GatewayState, record: RequestRecord, error: ApiError) -> None:
    """A request refused before any response was sent."""
    _set_failure(record, error)
    record.ttft_s = None
    _hand_over(state, record)


def record_end(
    state: GatewayState,
    record: RequestRecord,
    finish: Finish | None,
    failure: ApiError | None,
    finish_reason: str,
    opened: OpenGeneration | None = None,
) -> None:
    """A request that was answered (completely, or cut by an error or a disconnect); `opened` tells what a
    cut one streamed and found cached before it ended."""
    if finish is not None:
        record.cached_tokens = finish.usage.cached_tokens
        record.l1_cached_tokens = finish.usage.l1_cached_tokens
        record.rank = finish.rank
        record.rank_switches = finish.rank_switches
        record.output_tokens = finish.usage.output_tokens
        record.queue_wait_s = finish.queue_wait_s
        record.ttft_s = finish.ttft_s
        record.decode_s = finish.decode_s
        record.finish_reason = finish_reason
    else:
        record.ttft_s = None  # not measured for a request that did not finish
        if opened is not None:
            _record_partial(record, opened)
    if failure is not None:
        _set_failure(record, failure)
    _hand_over(state, record)


def _record_partial(record: RequestRecord, opened: OpenGeneration) -> None:
    """What a request that did not finish had done: the tokens passed on, and the cache use the rank reported
    with its first chunk (of the stream that served the prompt, as a finished request's usage is)."""
    cache = opened.cache_stream or opened.stream
    usage = opened.prompt_usage()
    record.cached_tokens = usage.cached_tokens
    record.l1_cached_tokens = usage.l1_cached_tokens
    record.output_tokens = usage.output_tokens
    record.rank = opened.choice.rank_id if opened.choice is not None else ""  # none: no rank came back in time
    record.rank_switches = opened.rank_switches
    if cache is not None and cache.tokens_sent:
        record.queue_wait_s = cache.queue_wait_s


def _set_failure(record: RequestRecord, error: ApiError) -> None:
    record.status, record.error_type = error.status, error.kind
    if error.kind == CANCELLED:
        record.finish_reason = "cancelled"


def _hand_over(state: GatewayState, record: RequestRecord) -> None:
    pending = _pending.get()
    if pending is None:
        pending = PendingRecord()
        pending.state, pending.record = state, record
        pending.settle(record.status)
        return
    pending.state, pending.record = state, record
