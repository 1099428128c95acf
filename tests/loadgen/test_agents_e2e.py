"""`kvserve bench agents` against the real stack (rank worker with the embedded SmolLM2 + gateway): a short
replay of a real Claude Code trace, shrunk to a few hundred tokens per prompt, judged from its JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from service_processes import gateway_stack

from loadgen.agents_cli import main

TRACE = Path(__file__).parent / "data" / "claude_code" / "trace_0369.json.gz"
RANK = {"KVSERVE_NUM_KV_BLOCKS": "512", "KVSERVE_MAX_MODEL_LEN": "4096", "KVSERVE_MAX_NUM_SEQS": "8"}
# Short everything: no think time, 8 output tokens, prompts of ~250 tokens (1% of the trace's ~25K).
SHORT = ["--think-time", "0", "--max-output-tokens", "8", "--context-scale", "0.01", "--quiet"]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with gateway_stack(tmp_path_factory.mktemp("agents-stack"), RANK, {}) as url:
        yield url


def test_two_agents_three_turns(base_url: str, tmp_path: Path) -> None:
    out = tmp_path / "agents.json"
    args = ["--url", base_url, "--agents", "2", "--turns", "3", "--trace-path", str(TRACE), "--out", str(out), *SHORT]
    assert main(args) == 0
    results = json.loads(out.read_text())
    assert results["max_context"] == 4096  # asked of the gateway (its refusal of an oversized prompt)
    (step,) = results["steps"]
    requests = results["requests"]
    # Every request answered; counts add up.
    assert step["agents"] == 2 and step["requests"] == step["answered"] == len(requests) == 6
    assert step["error_count"] == 0 and step["errors"] == 0.0
    assert step["cold_requests"] == 2 and step["warm_requests"] == 4
    assert [r["session_turn"] for r in requests if not r["warm"]] == [0, 0]
    assert step["input_tokens"] == sum(r["input_tokens"] for r in requests)
    assert step["cached_tokens"] == sum(r["cached_tokens"] for r in requests)
    # The gateway's per-tier counters saw the same cached tokens as the usage the clients got.
    assert step["l0_cached_tokens"] + step["l1_cached_tokens"] == step["cached_tokens"]
    for record in requests:
        assert record["error"] is None and record["ttft_s"] > 0
        assert record["output_tokens"] == record["max_tokens"] == 8  # ignore_eos: the trace's length (capped)
        # The content aims at the trace's scaled size: within 10% once the template is added.
        aimed = record["expected_input_tokens"] + results["template_tokens"]
        assert abs(record["input_tokens"] - aimed) <= 0.1 * aimed
        if record["warm"]:
            assert record["cached_tokens"] / record["input_tokens"] > 0.5, record
        else:
            # The second agent replays the same trace as another user: nothing of the first is reused.
            assert record["cached_tokens"] / record["input_tokens"] < 0.2, record
    assert step["cache_hit_warm"] > 0.5
    assert step["ttft_p95_warm"] is not None and step["ttft_p95_cold"] is not None
    assert set(step["failed"]) <= {"ttft_p95", "tok_s_p50", "tok_s_p10", "cache_hit"}  # a CPU is slow
    assert step["passed"] == (not step["failed"])
    for chart in ("ttft", "tok_s", "cache"):
        assert (tmp_path / f"agents-{chart}.png").stat().st_size > 1000


def test_openai_api(base_url: str, tmp_path: Path) -> None:
    out = tmp_path / "openai.json"
    args = ["--url", base_url, "--api", "openai", "--agents", "1", "--turns", "2", "--seed", "1"]
    args += ["--trace-path", str(TRACE), "--out", str(out), "--max-context", "4096", "--no-charts", *SHORT]
    assert main(args) == 0
    results = json.loads(out.read_text())
    (step,) = results["steps"]
    first, second = results["requests"]
    assert step["answered"] == 2 and not first["warm"] and second["warm"]
    assert first["cached_tokens"] < 0.2 * first["input_tokens"]  # a new seed: nothing of the other test's run
    assert second["cached_tokens"] > 0.5 * second["input_tokens"] and second["output_tokens"] == 8


def test_a_conversation_of_messages(base_url: str, tmp_path: Path) -> None:
    # --messages: each call a conversation (a user message per turn, the fixed reply between them), as Claude Code
    # sends one; the earlier messages come again word for word, so a warm call reads them from the prefix cache
    out = tmp_path / "messages.json"
    args = ["--url", base_url, "--agents", "1", "--turns", "3", "--seed", "2", "--messages", "--no-charts"]
    args += ["--trace-path", str(TRACE), "--out", str(out), *SHORT]
    assert main(args) == 0
    results = json.loads(out.read_text())
    assert results["workload"]["conversation"] == "messages"
    requests = results["requests"]
    assert [r["error"] for r in requests] == [None, None, None]
    for record in requests[1:]:
        assert record["warm"] and record["cached_tokens"] > 0.5 * record["input_tokens"], record
        aimed = record["expected_input_tokens"] + results["template_tokens"]
        assert abs(record["input_tokens"] - aimed) <= 0.15 * aimed, record  # the replies and markers are counted
    # the gateway tokenized the earlier messages once: their ids came from its segment cache after that
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    from_cache = [
        line
        for line in metrics.splitlines()
        if line.startswith('kvserve_gateway_tokenized_tokens_total{source="cache"}')
    ]
    assert from_cache and float(from_cache[0].split()[-1]) > sum(r["input_tokens"] for r in requests[1:]) * 0.5
