"""A one-rank stack (redis, kvstore, router, one rank worker with the embedded model, the gateway) whose only
rank fails and comes back, as an expert-parallel group's ranks do together: a stream cut by a SIGKILL, or by a
hang (SIGSTOP, noticed by the gateway, then killed), waits for the restarted rank and goes on from the prompt
plus the tokens already sent, the same text as an uninterrupted greedy run; a request sent while the rank is
down waits for it (a stream kept alive by pings) and completes once it is back."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_processes import request_log_line
from whole_stack import Stack, stream_message, whole_stack

STALL_S = 2.0  # the gateway's rank_stall_secs: a rank silent this long is hung
RECOVERY_WAIT_S = 90.0  # rank_recovery_wait_secs: well past a restart of the embedded model on 2 loaded cores
MAX_TOKENS = 80
# Long enough that the prompt fills several KV blocks (the L1 tier keeps full blocks).
PROMPT = "Here are my notes on caches. " + " ".join(f"Note {i}: caches keep hot data close." for i in range(20))
MESSAGES = [{"role": "user", "content": PROMPT + " Now write a long story about a cache."}]
GREEDY = {"temperature": 0, "ignore_eos": True}  # ignore_eos: always MAX_TOKENS tokens, time enough to cut


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    ranks = {"KVSERVE_NUM_KV_BLOCKS": "256", "KVSERVE_MAX_MODEL_LEN": "2048"}
    gateway = {
        "KVSERVE_PING_INTERVAL_SECS": "0.5",
        "KVSERVE_RANK_STALL_SECS": str(STALL_S),
        "KVSERVE_RANK_RECOVERY_WAIT_SECS": str(RECOVERY_WAIT_S),
    }
    with whole_stack(tmp_path_factory.mktemp("rank-recovery"), 1, ranks, gateway) as running:
        yield running


@pytest.fixture(autouse=True)
def rank_up(stack: Stack) -> Iterator[None]:
    """Each test finds the rank up (one a failed test left stopped or dead is resumed or started again)."""
    _restore(stack)
    yield
    _restore(stack)


def _restore(stack: Stack) -> None:
    rank = stack["rank-0"]
    if rank.alive():
        os.kill(rank.process.pid, signal.SIGCONT)  # type: ignore[union-attr]
    else:
        rank.start()
    stack.wait_ranks_healthy(1)


def _waiting_for_rank(url: str) -> float:
    """The gateway's requests waiting for a rank to come back, from /metrics."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "kvserve_gateway_requests_waiting_for_rank":
                return sample.value
    raise AssertionError("no kvserve_gateway_requests_waiting_for_rank in /metrics")


def _wait_until_waiting(url: str, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while _waiting_for_rank(url) < count:
        assert time.monotonic() < deadline, f"the gateway did not hold {count} request(s) waiting for a rank"
        time.sleep(0.05)


class Restart:
    """The only rank killed (SIGKILL) and started again on its port, in a thread: when it was killed, and
    when it was SERVING again."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.killed_at = 0.0
        self.ready_at = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def begin(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        rank = self.stack["rank-0"]
        try:
            rank.kill(signal.SIGKILL)
            self.killed_at = time.monotonic()
            rank.start()  # the same command on the same port: a new incarnation, loading its weights again
            self.ready_at = time.monotonic()
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self) -> None:
        self._thread.join(120)
        assert not self._thread.is_alive(), "the rank did not come back within 120 s"
        if self.error is not None:
            raise self.error


def _report(what: str, restart: Restart, first_continued_at: float) -> None:
    print(
        f"\n{what}: kill -> first continued token {first_continued_at - restart.killed_at:.2f} s "
        f"(the rank's restart took {restart.ready_at - restart.killed_at:.2f} s; the stream went on "
        f"{first_continued_at - restart.ready_at:.2f} s after it was SERVING)"
    )


def _l1_cached_tokens(stack: Stack, request_id_part: str) -> str:
    """What the rank's log says its finished request restored from L1."""
    for line in stack["rank-0"].log_path.read_text(errors="replace").splitlines():
        if "finished request=" in line and request_id_part in line:
            return line.split("l1_cached_tokens=")[1].split()[0]
    return "?"


def _anthropic_reference(stack: Stack) -> str:
    client = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0)
    message = client.messages.create(model="default", max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body=GREEDY)
    assert message.usage.output_tokens == MAX_TOKENS
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_stream_cut_by_a_killed_rank_goes_on_once_it_is_restarted(stack: Stack) -> None:
    reference = _anthropic_reference(stack)
    client = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=180)
    restart = Restart(stack)
    text: list[str] = []
    first_continued_at = 0.0
    log_offset = stack["gateway"].log_path.stat().st_size
    with client.messages.stream(model="default", max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body=GREEDY) as stream:
        for delta in stream.text_stream:
            text.append(delta)
            if len(text) == 3:  # tokens are flowing: the rank dies mid-stream
                restart.begin()
            elif restart.ready_at and not first_continued_at:
                first_continued_at = time.monotonic()  # the first token of the restarted rank
        final = stream.get_final_message()
    restart.join()
    # nothing lost or repeated: the uninterrupted run's text, all its tokens, one continuation
    assert "".join(text) == reference
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == MAX_TOKENS
    assert first_continued_at, "no token came after the rank was back: the stream was not cut mid-way"
    line = request_log_line(stack["gateway"].log_path, f"id={final.id}", since=log_offset)
    assert " rank_switches=1 " in f"{line} ", line
    _report("SIGKILL", restart, first_continued_at)
    print(f"the continuation restored {_l1_cached_tokens(stack, final.id + '+')} prompt tokens from L1")


def test_a_stream_on_a_hung_rank_goes_on_once_it_is_killed_and_restarted(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=180)
    body = {"model": "default", "max_tokens": MAX_TOKENS, "messages": MESSAGES, "extra_body": GREEDY}
    reference = client.chat.completions.create(**body).choices[0].message.content
    restart = Restart(stack)
    stopped_at = 0.0
    text: list[str] = []
    first_continued_at = 0.0

    def kill_once_the_gateway_waits() -> None:
        _wait_until_waiting(stack.url, 1, timeout_s=STALL_S + 20)  # it took the silent rank for hung
        restart.begin()

    watcher = threading.Thread(target=kill_once_the_gateway_waits, daemon=True)
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if not delta:
            continue
        text.append(delta)
        if len(text) == 3:  # tokens are flowing: the rank hangs (a machine thrashing, a stuck driver)
            os.kill(stack["rank-0"].process.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            stopped_at = time.monotonic()
            watcher.start()
        elif restart.ready_at and not first_continued_at:
            first_continued_at = time.monotonic()
    watcher.join(60)
    restart.join()
    assert "".join(text) == reference
    assert first_continued_at, "no token came after the rank was back: the stream was not cut mid-way"
    print(f"\nSIGSTOP: the gateway took the rank for hung and waited {restart.killed_at - stopped_at:.2f} s after it")
    _report("SIGSTOP then SIGKILL", restart, first_continued_at)


def test_requests_sent_while_the_only_rank_is_down_complete_once_it_is_back(stack: Stack) -> None:
    reference = _anthropic_reference(stack)
    rank = stack["rank-0"]
    rank.kill(signal.SIGKILL)

    def whole() -> anthropic.types.Message:  # not streamed: it just waits
        client = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=180)
        return client.messages.create(model="default", max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body=GREEDY)

    def streamed() -> tuple[list[str], str, dict]:  # streamed: pings keep it alive while it waits
        body = {"model": "default", "max_tokens": MAX_TOKENS, "stream": True, "messages": MESSAGES, **GREEDY}
        return stream_message(stack.url, body, timeout_s=180)

    with ThreadPoolExecutor(2) as pool:
        sent = pool.submit(whole), pool.submit(streamed)
        _wait_until_waiting(stack.url, 2)  # both are held, neither answered 503
        began = time.monotonic()
        rank.start()  # seconds: pings (ping_interval_secs 0.5) keep the stream alive meanwhile
        ready_at = time.monotonic()
        message, (names, text, last) = sent[0].result(120), sent[1].result(120)
    assert "".join(b.text for b in message.content if b.type == "text") == reference
    assert text == reference and names[-1] == "message_stop" and "error" not in names
    assert last["usage"]["output_tokens"] == MAX_TOKENS
    # pings kept the stream alive before its first token; message_start waited for that token (its cache use)
    start = names.index("message_start")
    assert "ping" in names[:start] and names[start + 1] == "content_block_start", names[: start + 3]
    assert _waiting_for_rank(stack.url) == 0
    print(f"\nnew requests while down: the rank restarted in {ready_at - began:.2f} s and both completed")
