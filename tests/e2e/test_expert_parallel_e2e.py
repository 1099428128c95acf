"""`kvserve up --ranks 2 --expert-parallel 2` end to end: a tiny DeepSeek-V2 checkpoint (MLA, 8 routed experts, 4 on
each rank of the group) served on the CPU through the gateway. Greedy streams (the official OpenAI and Anthropic
SDKs, one session each) run on both ranks of the group at once and give the text one plain rank of the same
checkpoint gives. A rank of the group killed (SIGKILL) or hung (SIGSTOP) mid-stream: its peer notices (a collective
fails, or its heartbeat stops within expert_parallel_timeout_secs) and exits with EXIT_GROUP_BROKEN, the launcher
restarts the whole group (the hung one SIGKILLed), and the gateway continues every cut stream from its prompt plus
the tokens already sent: every stream ends with the uninterrupted greedy text. Prints the recovery time (the
failure to the first continued token) and the group's restart time.

The launcher restarts a group at most 3 times a minute (launcher/supervisor.py): this module fails it 3 times.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import grpc
import openai
import pytest
from service_processes import ANY_PORTS, gateway_stack, request_log_line, running_process, service_env

from contracts import internal_auth
from contracts.expert_parallel import EXIT_GROUP_BROKEN
from protos import router_pb2, router_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests" / "rank_worker") not in sys.path:  # the tiny checkpoints' writers (deepseek_checkpoints.py)
    sys.path.insert(0, str(ROOT / "tests" / "rank_worker"))

from deepseek_checkpoints import VOCAB, write_deepseek  # noqa: E402

RANKS = ("rank-worker-0", "rank-worker-1")
GROUP = "ep-0"
STALL_S = 2.0  # the gateway's rank_stall_secs
GROUP_TIMEOUT_S = 3.0  # expert_parallel_timeout_secs: a peer silent this long is hung
RECOVERY_WAIT_S = 120.0  # rank_recovery_wait_secs: far past a group restart on 2 loaded cores
STREAMS = 4  # two sessions on each rank (the router balances new sessions by load)
MAX_TOKENS = 160  # long beside the client's lag: a rank must not finish a stream before it fails
STARTED_TOKENS = 4  # every stream has this many deltas when the rank fails: all are mid-stream
GREEDY = {"temperature": 0, "ignore_eos": True}  # ignore_eos: always MAX_TOKENS tokens, time enough to fail a rank
# Both stacks serve the checkpoint alike: float32, a small pool and token budget (a prompt and its continuation
# are prefilled in more than one chunk).
MODEL_SETTINGS = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 512, "max_num_batched_tokens": 32}


# Each test's streams, prompts of their own: a prompt served before would draw its stream to the rank that holds its
# prefix (the router's prefix match outweighs load), and each test needs streams on both ranks.
TESTS = ("plain", "SIGKILL-rank-worker-1", "SIGSTOP-rank-worker-0", "SIGSTOP-rank-worker-1")


def prompt(number: int) -> str:
    """A user message of the word tokenizer's words (w0 is its unknown word), one of its own per stream."""
    return " ".join(f"w{1 + (number * 13 + k * 7) % (VOCAB - 2)}" for k in range(16))


@dataclass
class Stream:
    """One streamed request and what arrived of it."""

    index: int
    tag: str  # the test's: prompts and sessions of its own (a session sticks to the rank that last served it)
    text: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic arrival of each delta
    response_id: str = ""

    @property
    def api(self) -> str:
        return "openai" if self.index % 2 == 0 else "anthropic"

    @property
    def session(self) -> str:
        return f"{self.tag}-{self.index}"


def run_stream(url: str, stream: Stream, on_delta: Callable[[], None] = lambda: None) -> str:
    """Stream one greedy request through the gateway with the official SDK of its API; its text."""
    messages = [{"role": "user", "content": prompt(TESTS.index(stream.tag) * STREAMS + stream.index)}]

    def arrived(delta: str) -> None:
        stream.text.append(delta)
        stream.times.append(time.monotonic())
        on_delta()

    if stream.api == "openai":
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180)
        chunks = client.chat.completions.create(
            model="default",
            max_tokens=MAX_TOKENS,
            messages=messages,  # type: ignore[arg-type]
            stream=True,
            extra_body=GREEDY,
            extra_headers={"x-session-id": stream.session},
        )
        for chunk in chunks:
            stream.response_id = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                arrived(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                assert chunk.choices[0].finish_reason == "length"
    else:
        client_a = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=180)
        with client_a.messages.stream(
            model="default",
            max_tokens=MAX_TOKENS,
            messages=messages,  # type: ignore[arg-type]
            extra_body=GREEDY,
            extra_headers={"x-claude-code-session-id": stream.session},
        ) as events:
            for delta in events.text_stream:
                arrived(delta)
            final = events.get_final_message()
        stream.response_id = final.id
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == MAX_TOKENS
    return "".join(stream.text)


class Streams:
    """STREAMS streams at once, sessions new to the stack; `started` once each has STARTED_TOKENS deltas."""

    def __init__(self, url: str, tag: str) -> None:
        self.streams = [Stream(index, tag) for index in range(STREAMS)]
        self.started = threading.Event()
        self._pool = ThreadPoolExecutor(STREAMS)
        self._futures = [self._pool.submit(run_stream, url, stream, self._progress) for stream in self.streams]

    def _progress(self) -> None:
        if all(len(stream.text) >= STARTED_TOKENS for stream in self.streams):
            self.started.set()

    def wait_started(self, timeout_s: float = 60) -> None:
        if not self.started.wait(timeout_s):
            for future in self._futures:
                if future.done():
                    future.result()  # its error
            raise AssertionError(f"the streams did not all start within {timeout_s} s")

    def texts(self, timeout_s: float = 180) -> list[str]:
        try:
            return [future.result(timeout_s) for future in self._futures]
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Stack:
    process: subprocess.Popen[bytes]
    output: Path
    state_dir: Path

    def services(self) -> dict[str, dict]:
        """services.json: the launcher replaces it whole (write then rename), so it always parses."""
        return json.loads((self.state_dir / "services.json").read_text())

    def service(self, name: str) -> dict:
        return next(entry for entry in self.services()["services"] if entry["name"] == name)

    def group(self) -> dict:
        return next(group for group in self.services()["groups"] if group["name"] == GROUP)

    def pid(self, name: str) -> int:
        return int(self.service(name)["pid"])

    @property
    def url(self) -> str:
        return f"http://{self.service('gateway')['address']}"

    def log(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def idle_ranks_at_router(self) -> int:
        """Healthy ranks with nothing running or waiting, as their last heartbeats told the router."""
        secret = internal_auth.read_secret_file(self.state_dir / "internal-secret")
        with internal_auth.channel(str(self.service("router")["address"]), secret=secret) as channel:
            ranks = router_pb2_grpc.RouterStub(channel).ListRanks(router_pb2.ListRanksRequest(), timeout=10).ranks
        return sum(rank.healthy and not rank.load.running and not rank.load.waiting for rank in ranks)


def wait_until(what: str, check: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> float:
    """Poll `check` until it holds; the monotonic time it was first seen to."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return time.monotonic()
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, f"{what}: not so after {timeout_s} s"
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deepseek-v2")
    write_deepseek("deepseek_v2", directory)
    return directory


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Each test's streams' greedy texts from one plain rank holding every expert (each test's streams at once)."""
    settings = {f"KVSERVE_{key.upper()}": str(value) for key, value in MODEL_SETTINGS.items()}
    with gateway_stack(tmp_path_factory.mktemp("one-rank"), {"KVSERVE_MODEL": str(checkpoint), **settings}, {}) as url:
        texts = {tag: Streams(url, tag).texts() for tag in TESTS}
    every = [text for group in texts.values() for text in group]
    assert all(len(text.split()) == MAX_TOKENS for text in every), texts  # one word per token
    assert len(set(every)) == len(every), texts  # the prompts lead to different texts
    return texts


@pytest.fixture(scope="module")
def stack(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("kvserve-up-ep")
    output, state_dir, config_file = tmp / "up.log", tmp / "state", tmp / "config.yaml"
    config = {
        "model": str(checkpoint),
        **MODEL_SETTINGS,
        "l1_host_gb": 0.25,
        "l1_arena_dir": str(tmp),
        "rank_stall_secs": STALL_S,
        "rank_recovery_wait_secs": RECOVERY_WAIT_S,
        "expert_parallel_timeout_secs": GROUP_TIMEOUT_S,
        "ping_interval_secs": 0.5,
        "heartbeat_interval_secs": 0.5,
    }
    config_file.write_text("".join(f"{key}: {value}\n" for key, value in config.items()))

    def ready(process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 240
        while "Ctrl-C" not in output.read_text(errors="replace"):  # printed once the gateway is ready
            assert time.monotonic() < deadline and process.poll() is None, output.read_text(errors="replace")
            time.sleep(0.2)

    command = [sys.executable, "-m", "launcher.cli", "up", "--ranks", "2", "--expert-parallel", "2"]
    command += ["--config", str(config_file), "--state-dir", str(state_dir)]
    with running_process(
        command, service_env(**ANY_PORTS), output, ready, stop_signal=signal.SIGINT, stop_timeout_s=60
    ) as process:
        yield Stack(process, output, state_dir)
    print(output.read_text(errors="replace")[-3000:])


@pytest.fixture(autouse=True)
def group_up(stack: Stack) -> Iterator[None]:
    """Each test finds the group serving (a rank a failed test left stopped is resumed) and the stack running."""
    _restore(stack)
    yield
    _restore(stack)


def _restore(stack: Stack) -> None:
    for name in RANKS:
        with contextlib.suppress(ProcessLookupError):  # exited: the launcher restarts the group
            os.kill(stack.pid(name), signal.SIGCONT)
    assert stack.process.poll() is None, stack.output.read_text(errors="replace")[-3000:]
    wait_until("the group serving", lambda: not stack.group()["recovering"] and _alive(stack), 120)
    # idle as the router knows them: load a heartbeat has not yet cleared would send every new session to the other
    wait_until("both ranks healthy and idle at the router", lambda: stack.idle_ranks_at_router() == 2, 60)


def _alive(stack: Stack) -> bool:
    for name in RANKS:
        try:
            os.kill(stack.pid(name), 0)
        except ProcessLookupError:
            return False
    return True


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def ranks_of(stack: Stack, streams: Streams) -> dict[str, str]:
    """The rank each stream first ran on: the rank log that accepted its request id (a continuation's is id+N)."""
    logs = {name: stack.log(name).read_text(errors="replace") for name in RANKS}
    found: dict[str, str] = {}
    for stream in streams.streams:
        found[stream.session] = ",".join(
            name for name, text in logs.items() if f"accepted request={stream.response_id} " in text
        )
    return found


def assert_on_both_ranks(stack: Stack, streams: Streams) -> None:
    placed = ranks_of(stack, streams)
    assert sorted(set(placed.values())) == list(RANKS), placed


def test_streams_on_both_ranks_of_the_group_give_one_rank_s_greedy_text(
    stack: Stack, reference: dict[str, list[str]]
) -> None:
    restarts = stack.group()["restarts"]
    streams = Streams(stack.url, "plain")
    assert streams.texts() == reference["plain"]
    assert_on_both_ranks(stack, streams)
    assert stack.group()["restarts"] == restarts
    for name in RANKS:  # each rank holds half the routed experts
        assert "expert-parallel group ep-0 formed" in stack.log(name).read_text(errors="replace")


@dataclass
class Failure:
    """A rank of the group failed mid-stream, and the group's restart as services.json tells it."""

    failed_at: float
    restarted_at: float  # the launcher had started the group's ranks again
    serving_at: float  # and both were healthy
    first_exit: dict

    def report(self, what: str, stack: Stack, streams: Streams) -> None:
        """Print the recovery time: the failure to each stream's first continued token (its token N + 1, the
        continuation being request id+N; the word tokenizer's tokens are one word each, a delta one or more)."""
        continued = []
        for stream in streams.streams:
            sent = continuation_offset(stack, stream)
            assert STARTED_TOKENS <= sent < MAX_TOKENS, sent
            words = 0
            for delta, at in zip(stream.text, stream.times, strict=True):
                words += len(delta.split())
                if words > sent:
                    continued.append(at - self.failed_at)
                    break
        print(
            f"\n{what}: failure -> first continued token {min(continued):.2f} s (the last stream's "
            f"{max(continued):.2f} s); the launcher restarted the group {self.restarted_at - self.failed_at:.2f} s "
            f"after the failure and it served again {self.serving_at - self.restarted_at:.2f} s later "
            f"(first exit: {self.first_exit['member']}, code {self.first_exit['code']})"
        )


def continuation_offset(stack: Stack, stream: Stream, timeout_s: float = 10) -> int:
    """N of the continuation (request id+N: the N tokens already sent) that finished the stream, from the ranks'
    logs (a rank logs a request's end as its last token goes out: waited for)."""
    finished = re.compile(rf"finished request={re.escape(stream.response_id)}\+(\d+) ")
    found: list[int] = []

    def logged() -> bool:
        texts = [stack.log(name).read_text(errors="replace") for name in RANKS]
        found[:] = [int(match.group(1)) for text in texts for match in finished.finditer(text)]
        return bool(found)

    wait_until(f"a continuation of {stream.response_id} finished", logged, timeout_s)
    assert len(found) == 1, found
    return found[0]


def fail_mid_stream(stack: Stack, name: str, sig: signal.Signals) -> tuple[Streams, list[str], Failure]:
    """Streams on both ranks; once each has a few deltas, `sig` to rank `name`; wait out the group's restart."""
    restarts, pid = stack.group()["restarts"], stack.pid(name)
    streams = Streams(stack.url, f"{sig.name}-{name}")
    streams.wait_started()
    os.kill(pid, sig)
    failed_at = time.monotonic()
    restarted_at = wait_until("the group restarted", lambda: stack.group()["restarts"] == restarts + 1, 60)
    serving_at = wait_until("the group serving again", lambda: not stack.group()["recovering"], 120)
    texts = streams.texts()
    assert _gone(pid), f"{name}'s old process (pid {pid}) is still there"
    return streams, texts, Failure(failed_at, restarted_at, serving_at, stack.group()["first_exit"])


def assert_every_stream_continued(stack: Stack, streams: Streams) -> None:
    """Each stream was cut once and continued on the restarted group (the gateway's request line)."""
    gateway_log = stack.log("gateway")
    for stream in streams.streams:
        line = request_log_line(gateway_log, f"id={stream.response_id} ")
        # once or twice: a continuation sent to the hung rank's peer before the peer noticed is cut again
        assert " rank_switches=1 " in f"{line} " or " rank_switches=2 " in f"{line} ", line


def test_a_killed_rank_of_the_group_cuts_no_stream(stack: Stack, reference: dict[str, list[str]]) -> None:
    streams, texts, failure = fail_mid_stream(stack, "rank-worker-1", signal.SIGKILL)
    assert texts == reference["SIGKILL-rank-worker-1"]
    assert_on_both_ranks(stack, streams)
    assert_every_stream_continued(stack, streams)
    assert failure.first_exit == {"member": "rank-worker-1", "code": -signal.SIGKILL}
    assert f"expert-parallel group {GROUP}: rank-worker-1 exited first, with code -9" in stack.output.read_text()
    failure.report("SIGKILL of rank-worker-1", stack, streams)


@pytest.mark.parametrize("hung", RANKS)
def test_a_hung_rank_of_the_group_is_noticed_by_its_peer_and_cuts_no_stream(
    stack: Stack, reference: dict[str, list[str]], hung: str
) -> None:
    """rank-worker-0 hosts the group's store: hung, it answers neither collectives nor its peer's heartbeat
    calls (which then never return: its peer's watch on them notices); rank-worker-1 hung stops beating."""
    peer = next(name for name in RANKS if name != hung)
    streams, texts, failure = fail_mid_stream(stack, hung, signal.SIGSTOP)
    assert texts == reference[f"SIGSTOP-{hung}"]
    assert_on_both_ranks(stack, streams)
    assert_every_stream_continued(stack, streams)
    # the peer noticed within its timeout (checked every timeout/5) and exited; the launcher looks every 0.5 s
    assert failure.first_exit == {"member": peer, "code": EXIT_GROUP_BROKEN}
    assert failure.restarted_at - failure.failed_at < GROUP_TIMEOUT_S + 4.0, failure
    why = "the group's store at .* has not answered" if hung == "rank-worker-0" else "rank 1 has not answered"
    broken = f"expert-parallel group {GROUP} broken at rank {RANKS.index(peer)}: {why}"
    assert re.search(broken, stack.log(peer).read_text()), stack.log(peer).read_text()[-3000:]
    failure.report(f"SIGSTOP of {hung}", stack, streams)
