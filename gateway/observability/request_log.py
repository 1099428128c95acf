"""One logfmt line per finished request (ids, token counts, cache hit, timings, outcome), and, only when the
operator turned log_prompts on, a separate line with the truncated prompt."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

REQUEST_LOGGER = logging.getLogger("kvserve.gateway.requests")
# Its own logger, so an operator can route prompt text (user data) elsewhere or drop it.
PROMPT_LOGGER = logging.getLogger("kvserve.gateway.prompts")

PROMPT_LOG_CHARS = 2000  # head and tail of the prompt together
MAX_FIELD_CHARS = 200  # client-chosen strings (model, session) cannot flood the log


@dataclass
class RequestRecord:
    """What the app learns about a request while serving it; filled in as it goes, logged at the end."""

    request_id: str
    api: str  # anthropic | openai
    model: str = ""
    session: str = ""  # X-Claude-Code-Session-Id, or the session id found in metadata
    status: int = 200
    prompt_tokens: int = 0  # cached ones included
    cached_tokens: int = 0  # from any tier
    l1_cached_tokens: int = 0  # of those, restored from the host cache (L1)
    output_tokens: int = 0
    rank: str = ""  # the rank that served it (the last one, after a switch)
    rank_switches: int = 0  # the stream went on on another rank after a failure
    prepare_s: float | None = None  # from receiving the request to a rank accepting it (parse, tokenize, route)
    tokenize_s: float | None = None  # of that, rendering the prompt and tokenizing it (in a worker thread)
    queue_wait_s: float | None = None  # until a rank started the prefill
    ttft_s: float | None = None  # from receiving the request to the first output token
    decode_s: float | None = None  # from the first output token to the last
    finish_reason: str = ""  # as sent to the client: end_turn, tool_use, length, ...
    error_type: str = ""  # the API error type when status is not 200
    prompt_text: str = ""  # logged only with log_prompts

    @property
    def hit_pct(self) -> float | None:
        return 100.0 * self.cached_tokens / self.prompt_tokens if self.prompt_tokens > 0 else None

    @property
    def tokens_per_s(self) -> float | None:
        # The first token belongs to the prefill (TTFT); decode_s covers the ones after it.
        if self.decode_s is None or self.decode_s <= 0 or self.output_tokens < 2:
            return None
        return (self.output_tokens - 1) / self.decode_s


def format_request_line(record: RequestRecord) -> str:
    fields: list[tuple[str, str]] = [
        ("id", _text(record.request_id)),
        ("session", _text(record.session)),
        ("api", _text(record.api)),
        ("model", _text(record.model)),
        ("status", str(record.status)),
        ("prompt_tokens", str(record.prompt_tokens)),
        ("cached_tokens", str(record.cached_tokens)),
        ("l0_cached", str(record.cached_tokens - record.l1_cached_tokens)),
        ("l1_cached", str(record.l1_cached_tokens)),
        ("hit_pct", _number(record.hit_pct, 1)),
        ("prepare_ms", _number(_ms(record.prepare_s), 1)),
        ("tokenize_ms", _number(_ms(record.tokenize_s), 1)),
        ("queue_ms", _number(_ms(record.queue_wait_s), 1)),
        ("ttft_ms", _number(_ms(record.ttft_s), 1)),
        ("output_tokens", str(record.output_tokens)),
        ("tok_s", _number(record.tokens_per_s, 1)),
        ("finish", _text(record.finish_reason)),
        ("rank", _text(record.rank)),
    ]
    if record.rank_switches:
        fields.append(("rank_switches", str(record.rank_switches)))
    if record.error_type:
        fields.append(("error", _text(record.error_type)))
    return "request " + " ".join(f"{key}={value}" for key, value in fields)


def format_prompt_line(record: RequestRecord, max_chars: int = PROMPT_LOG_CHARS) -> str:
    """The prompt, marked as debug output, cut in the middle: the head (system prompt) and the tail (latest
    turn) say the most."""
    prompt = record.prompt_text
    cut = max(0, len(prompt) - max_chars)
    if cut:
        head = max_chars // 2
        prompt = f"{prompt[:head]}…[{cut} chars cut]…{prompt[len(prompt) - (max_chars - head) :]}"
    return (
        f"prompt_debug id={_text(record.request_id)} log_prompts=true chars={len(record.prompt_text)} "
        f"cut_chars={cut} prompt={_quote(prompt)}"
    )


def log_request(
    record: RequestRecord,
    *,
    log_prompts: bool = False,
    logger: logging.Logger = REQUEST_LOGGER,
    prompt_logger: logging.Logger = PROMPT_LOGGER,
) -> None:
    logger.info(format_request_line(record))
    if log_prompts and record.prompt_text:
        prompt_logger.info(format_prompt_line(record))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _text(value: str) -> str:
    if not value:
        return "-"
    value = value[:MAX_FIELD_CHARS]
    plain = value.isprintable() and value.isascii() and not any(char in value for char in ' ="\\')
    return value if plain else _quote(value)


def _quote(value: str) -> str:
    # JSON escapes quotes and control characters; the three other line breaks some viewers honour are added,
    # so one request is always one line.
    quoted = json.dumps(value, ensure_ascii=False)
    quoted = quoted.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    # A lone surrogate (a client's \ud800) cannot be written as UTF-8: escaped, so the line is not lost.
    return quoted.encode("utf-8", "backslashreplace").decode("utf-8")
