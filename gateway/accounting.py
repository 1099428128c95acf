"""At the end of every request, whatever its API: the log line and the metrics."""

from __future__ import annotations

from gateway.generation import Finish
from gateway.request_flow import ApiError
from gateway.request_log import RequestRecord, log_request
from gateway.state import GatewayState


def record_failure(state: GatewayState, record: RequestRecord, error: ApiError) -> None:
    """A request refused before any response was sent."""
    record.status, record.error_type = error.status, error.kind
    state.metrics.observe_request(record.api, error.status, prompt_tokens=record.prompt_tokens)  # type: ignore[arg-type]
    state.metrics.observe_error(error.kind)
    log_request(record, log_prompts=state.config.log_prompts)


def record_end(
    state: GatewayState, record: RequestRecord, finish: Finish | None, failure: ApiError | None, finish_reason: str
) -> None:
    """A request that was answered (completely, or cut by an error or a disconnect)."""
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
    if failure is not None:
        record.status, record.error_type = failure.status, failure.kind
        state.metrics.observe_error(failure.kind)
    state.metrics.observe_request(
        record.api,  # type: ignore[arg-type]
        record.status,
        ttft_s=record.ttft_s if finish else None,
        prompt_tokens=record.prompt_tokens,
        cached_tokens={"l0": record.cached_tokens - record.l1_cached_tokens, "l1": record.l1_cached_tokens},
        output_tokens=record.output_tokens,
    )
    log_request(record, log_prompts=state.config.log_prompts)
