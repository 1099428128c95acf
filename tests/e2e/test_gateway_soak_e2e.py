"""A soak through the gateway: Messages streams from a dozen clients at once, sessions whose conversations grow,
into two rank workers with a tiny L0 pool (preemptions) and an L1 arena, a third dropped by their client mid-stream.
The soak's own load meets a full pool mostly as warm requests waiting for room (l1_room_waits), which preempts
nobody, so it first sends a burst of long decodes on one session (one rank) that cannot all fit: preemption by
design, whatever the machine's speed.
At the end nothing is held anywhere: no request in flight at the gateway, no block referenced in any L0 pool,
no slot pinned or half-written in L1, and every request was logged once, status 200, or 499 for one the gateway
saw dropped (no error).

Real processes: redis-server, kvstore, router, two rank workers (the embedded SmolLM2), gateway; the clients
speak HTTP. tests/e2e/test_soak_component.py pushes thousands of requests through the router and the ranks,
the test standing in for the gateway."""

from __future__ import annotations

import json
import random
import re
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from whole_stack import Stack, whole_stack

REQUESTS = 64
# Each burst request: 90 words (~120 tokens with the template) + 64 decoded = 12-13 blocks: two decoding at once
# outgrow the pool of 20
BURST = 6
BURST_WORDS = 90
BURST_TOKENS = 64
CONCURRENCY = 12
SESSIONS = 16
MAX_HISTORY_CHARS = 500  # a session's conversation starts again past this (~150 tokens)
RANK_SETTINGS = {
    "KVSERVE_NUM_KV_BLOCKS": "20",  # 320 tokens: a dozen conversations outgrow it
    "KVSERVE_MAX_MODEL_LEN": "256",
    "KVSERVE_MAX_NUM_SEQS": "12",
    "KVSERVE_MAX_NUM_BATCHED_TOKENS": "128",
}
WORDS = ["cache", "block", "rank", "router", "session", "token", "prefix", "arena", "slot", "stream", "decode"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gateway-soak")
    with whole_stack(tmp, ranks=2, rank_settings=RANK_SETTINGS, l1_host_gb="0.25") as s:
        yield s


class SoakClient:
    """Streams /v1/messages for growing session conversations; drops a third of the streams mid-way."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lock = threading.Lock()
        self.conversations: list[list[dict]] = [[] for _ in range(SESSIONS)]
        self.outcomes = {"finished": 0, "cancelled": 0}
        self.failures: list[str] = []

    def one(self, index: int) -> None:
        rng = random.Random(index)
        session = index % SESSIONS
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 30)))
        with self.lock:  # a session's conversation grows turn by turn, as an agent's does
            history = self.conversations[session]
            if sum(len(message["content"]) for message in history) > MAX_HISTORY_CHARS:
                history = []
            messages = [*history, {"role": "user", "content": question}]
        cancel_after = rng.randrange(0, 6) if rng.random() < 0.33 else None
        text = self.stream(f"request {index}", f"soak-{session}", messages, rng.randrange(8, 24), cancel_after)
        if text is not None:
            with self.lock:
                self.conversations[session] = [*messages, {"role": "assistant", "content": text or "ok"}]

    def burst(self, index: int) -> None:
        """One of BURST long decodes sent at once on one session: they outgrow the pool together."""
        rng = random.Random(-1 - index)
        question = " ".join(rng.choice(WORDS) for _ in range(BURST_WORDS))
        messages = [{"role": "user", "content": question}]
        self.stream(f"burst request {index}", "soak-burst", messages, BURST_TOKENS, None)

    def stream(
        self, label: str, session: str, messages: list[dict], max_tokens: int, cancel_after: int | None
    ) -> str | None:
        """Streams one request; returns its text once finished, None when dropped (or failed: self.failures)."""
        body = {
            "model": "default",
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "ignore_eos": True,
            "stream": True,
            "messages": messages,
        }
        headers = {"x-claude-code-session-id": session}
        names: list[str] = []
        text: list[str] = []
        with httpx.stream("POST", f"{self.url}/v1/messages", json=body, headers=headers, timeout=120) as response:
            if response.status_code != 200:
                self.failed(f"{label}: {response.status_code} {response.read()[:200]!r}")
                return None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    names.append(line[7:])
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if data.get("type") == "content_block_delta":
                        text.append(data["delta"].get("text", ""))
                        if cancel_after is not None and len(text) > cancel_after:
                            break  # leaving the block drops the connection mid-stream
            else:
                if names[-1:] != ["message_stop"] or "error" in names:
                    self.failed(f"{label}: events {names}")
                    return None
                with self.lock:
                    self.outcomes["finished"] += 1
                return "".join(text)
        with self.lock:
            self.outcomes["cancelled"] += 1
        return None

    def failed(self, detail: str) -> None:
        with self.lock:
            self.failures.append(detail)


def gateway_gauge(url: str, name: str) -> float:
    """A gauge of the gateway's /metrics, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        total += sum(sample.value for sample in family.samples if sample.name == name)
    return total


def request_statuses(stack: Stack) -> Counter[str]:
    """The status of each request the gateway logged, by how many had it."""
    log = stack["gateway"].log_path.read_text(errors="replace")
    return Counter(re.findall(r" request id=\S+ .* status=(\d+) ", log))


def test_soak_through_the_gateway_ends_with_nothing_held(stack: Stack) -> None:
    client = SoakClient(stack.url)
    with ThreadPoolExecutor(BURST) as pool:
        for future in [pool.submit(client.burst, i) for i in range(BURST)]:
            future.result(timeout=300)
    assert client.failures == [] and client.outcomes == {"finished": BURST, "cancelled": 0}
    assert sum(stack.rank_stats(name).preemptions for name in stack.rank_names()) > 0  # the pool was too small
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for future in [pool.submit(client.one, i) for i in range(REQUESTS)]:
            future.result(timeout=300)
    assert client.failures == []
    assert sum(client.outcomes.values()) == BURST + REQUESTS
    assert client.outcomes["cancelled"] > REQUESTS // 5 and client.outcomes["finished"] > BURST + REQUESTS // 2

    def drained() -> bool:
        return (
            stack.holds_nothing()
            and gateway_gauge(stack.url, "kvserve_gateway_requests_in_flight") == 0
            and gateway_gauge(stack.url, "kvserve_gateway_requests_waiting_for_rank") == 0
        )

    stack.wait_until("nothing held in the gateway, L0 or L1", drained, timeout_s=60)
    stack.wait_until(
        "every request logged by the gateway", lambda: sum(request_statuses(stack).values()) == BURST + REQUESTS, 30
    )
    statuses = request_statuses(stack)
    assert set(statuses) <= {"200", "499"} and statuses["499"] > 0, statuses
    ranks = [stack.rank_stats(name) for name in stack.rank_names()]
    assert sum(r.l1_offloaded_blocks for r in ranks) > 0
    assert sum(r.finished_requests for r in ranks) >= BURST + REQUESTS
    assert stack.kvstore_stats().stored_slots > 0
