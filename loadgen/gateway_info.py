"""What the load generator asks the gateway before and around a run: the served model and its context,
token counts (to calibrate the content), and the cache-tier counters of /metrics."""

from __future__ import annotations

import re
import sys

import httpx

from loadgen.content import Prompt, calibration_text

# Keys other OpenAI-compatible servers use for the context window in /v1/models entries.
CONTEXT_KEYS = ("max_model_len", "context_length", "context_window", "max_context_length")
CACHED_TOKENS = re.compile(r'^kvserve_gateway_cached_tokens_total\{tier="(l0|l1)"\}\s+([0-9.eE+-]+)', re.MULTILINE)
TOO_LONG = re.compile(r"context is (\d+) tokens")
PROBE_TOKENS = 2_200_000  # more than any served context (1M-token models included)


def served_model(client: httpx.Client) -> tuple[str, int | None]:
    """The first model name of GET /v1/models and its context window when the listing gives one."""
    response = client.get("/v1/models")
    response.raise_for_status()
    entry = response.json()["data"][0]
    context = next((int(entry[key]) for key in CONTEXT_KEYS if isinstance(entry.get(key), int)), None)
    return str(entry["id"]), context


def probe_context(client: httpx.Client, model: str) -> int | None:
    """The context window from the gateway's refusal of a prompt longer than any model's window: refused
    while preparing, before any rank sees it. None if the refusal does not say (or the body is refused)."""
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": " a" * PROBE_TOKENS}]}
    response = client.post("/v1/messages", json=body, timeout=120)
    match = TOO_LONG.search(response.text) if response.status_code == 400 else None
    return int(match.group(1)) if match else None


def count_tokens(client: httpx.Client, model: str, prompt: Prompt) -> int:
    """Tokens of the rendered prompt (template included) by POST /v1/messages/count_tokens."""
    body: dict = {"model": model, "messages": [{"role": "user", "content": prompt.user}]}
    if prompt.system:
        body["system"] = prompt.system
    response = client.post("/v1/messages/count_tokens", json=body)
    response.raise_for_status()
    return int(response.json()["input_tokens"])


def calibrate(client: httpx.Client, model: str, small: int = 400, large: int = 2400) -> tuple[float, int]:
    """Tokens per content word, from two counts whose difference cancels the chat template's own tokens,
    and those template tokens (the small count minus its words' share)."""
    few = count_tokens(client, model, Prompt(system="", user=calibration_text(small)))
    many = count_tokens(client, model, Prompt(system="", user=calibration_text(large)))
    tokens_per_word = max(0.1, (many - few) / (large - small))
    return tokens_per_word, max(0, few - round(small * tokens_per_word))


def cached_tokens_by_tier(client: httpx.Client) -> dict[str, float]:
    """kvserve_gateway_cached_tokens_total per tier (l0, l1); zeros when /metrics is not there."""
    tiers = {"l0": 0.0, "l1": 0.0}
    try:
        response = client.get("/metrics")
    except httpx.HTTPError:
        return tiers
    if response.status_code == 200:
        for tier, value in CACHED_TOKENS.findall(response.text):
            tiers[tier] = float(value)
    elif response.status_code in (401, 403) and not _warned_metrics_refused:
        _warn_metrics_refused(response.status_code)
    return tiers


_warned_metrics_refused = False


def _warn_metrics_refused(status: int) -> None:
    """Once: a gateway with keys on serves /metrics only to keys with the metrics scope, and without it the
    per-tier cache counts read as zero."""
    global _warned_metrics_refused
    _warned_metrics_refused = True
    print(
        f"warning: the gateway answered /metrics with {status}: the L0/L1 cache counts will read 0; give the load "
        "generator a key with the metrics scope (kvserve keys create --name load --models '*' --metrics)",
        file=sys.stderr,
    )
