"""The CPU node's compose stack under a real Docker daemon (make test-compose; tests/compose/run builds the images
and starts the daemon): `kvserve compose --cpu` renders the file, `docker compose up` starts it with one rank,
and then, in this order:

- a Messages request (Anthropic SDK) and a Chat request (OpenAI SDK) are answered through the published port;
- the gateway requires a key: 401 without one or with a wrong one;
- only the gateway's port is published (every other service is on the internal network alone);
- every secret is mounted with mode 0600, owned by uid 1000, and the kvserve services run as that user (Redis
  reads its password as root, then runs as the redis user);
- `docker compose restart` of the router, the kvstore and Redis, each while a stream is flowing, breaks no
  stream, and each comes back healthy;
- the rank's process killed mid-stream (a crash): its container restarts by its policy and the stream, waiting
  for it, is answered in full; `docker kill` of the rank instead is a manual stop to Docker (no policy restarts
  it), and the waiting stream completes once compose starts it again;
- with two ranks (where memory allows): the serving rank crashes mid-stream, the other finishes the stream, the
  crashed one restarts by its policy;
- `docker compose down -v` leaves no container, volume or network.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml
from compose_stack import CONTAINER_UID, ComposeStack, run, stream_story
from service_processes import free_port

pytestmark = pytest.mark.skipif(
    not os.environ.get("KVSERVE_COMPOSE_DIR"), reason="make test-compose runs these, with a Docker daemon of its own"
)

STREAM_TOKENS = 120  # ~8 s of decode on two busy cores: the attack lands while the stream is flowing
ATTACK_AT = 8  # text deltas received before the attack
GREEDY = {"temperature": 0}  # the Anthropic SDK no longer takes temperature as an argument; the API still does
PROJECT = "kvserve"  # the compose file's name: the prefix of its networks


@pytest.fixture(scope="module")
def stack() -> Iterator[ComposeStack]:
    running = ComposeStack(Path(os.environ["KVSERVE_COMPOSE_DIR"]))
    running.prepare(free_port())
    running.render(ranks=1)
    try:
        took = running.up(preflight=True)
        print(f"\ndocker compose up, one rank: every service healthy after {took:.0f} s")
        yield running
    finally:
        running.down()  # its logs kept; where up or a test failed before test_down_leaves_nothing


def document(stack: ComposeStack) -> dict[str, Any]:
    return yaml.safe_load(stack.compose_file.read_text())


def answered(stack: ComposeStack) -> str:
    reply = stack.client().messages.create(
        model="default", max_tokens=8, extra_body=GREEDY, messages=[{"role": "user", "content": "Say hello."}]
    )
    assert reply.usage.output_tokens > 0 and reply.content[0].type == "text"
    return reply.content[0].text


def continued_on(stack: ComposeStack, rank: str, message_id: str) -> bool:
    """Whether the rank took up the stream after a cut: the gateway sends it as `<id>+<tokens sent>`."""
    return f"accepted request={message_id}+" in stack.compose("logs", "--no-color", rank)


class AttackAt:
    """`action` on a thread of its own once the stream has received ATTACK_AT text deltas (the stream is read on
    meanwhile); pass it as the stream's on_delta. join() waits for it; `failures` holds what it raised."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.failures: list[BaseException] = []
        self._action = action
        self._thread = threading.Thread(target=self._run)

    def __call__(self, count: int, _message_id: str) -> None:
        if count == ATTACK_AT:
            self._thread.start()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self._action()
        except BaseException as exc:
            self.failures.append(exc)


def assert_whole(result: Any) -> None:
    """Every token of a greedy ignore_eos stream, ended by message_stop (the SDK raised on any error event)."""
    assert result.event_types[0] == "message_start" and result.event_types[-1] == "message_stop", result.event_types
    assert result.output_tokens == STREAM_TOKENS and result.text


def test_messages_and_chat_requests_answered(stack: ComposeStack) -> None:
    message = stack.client().messages.create(
        model="default",
        max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body=GREEDY,
    )
    assert message.content[0].text and message.usage.input_tokens > 0, message
    chat = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_key, max_retries=0, timeout=300)
    completion = chat.chat.completions.create(
        model="default", max_tokens=16, temperature=0, messages=[{"role": "user", "content": "Name a colour."}]
    )
    assert completion.choices[0].message.content and completion.usage.completion_tokens > 0, completion


def test_a_key_is_required(stack: ComposeStack) -> None:
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{stack.url}/v1/messages", json=body, timeout=30).status_code == 401
    assert httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30).status_code == 401
    with pytest.raises(anthropic.AuthenticationError):
        stack.client("sk-not-a-key").messages.create(**body)
    wrong = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-not-a-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(**body)


def test_only_the_gateways_port_is_published(stack: ComposeStack) -> None:
    published: dict[str, list[str]] = {}
    for service in document(stack)["services"]:
        container = stack.inspect(service)
        bindings = container["HostConfig"]["PortBindings"] or {}
        live = {port: hosts for port, hosts in (container["NetworkSettings"]["Ports"] or {}).items() if hosts}
        ports = sorted({host["HostPort"] for hosts in [*bindings.values(), *live.values()] for host in hosts})
        if ports:
            published[service] = ports
        networks = set(container["NetworkSettings"]["Networks"])
        expected = {f"{PROJECT}_internal", f"{PROJECT}_edge"} if service == "gateway" else {f"{PROJECT}_internal"}
        assert networks == expected, service
    assert published == {"gateway": [str(stack.port)]}
    internal = run(["docker", "network", "inspect", "-f", "{{.Internal}}", f"{PROJECT}_internal"]).strip()
    assert internal == "true"


def test_secrets_are_0600_and_the_containers_user_owns_them(stack: ComposeStack) -> None:
    services = document(stack)["services"]
    checked = 0
    for service, spec in services.items():
        for secret in spec.get("secrets", []):
            mode_owner = stack.exec(service, "stat", "-L", "-c", "%a %u", f"/run/secrets/{secret}").strip()
            assert mode_owner == f"600 {CONTAINER_UID}", (service, secret, mode_owner)
            checked += 1
        if service != "redis":
            assert stack.exec(service, "id", "-u").strip() == CONTAINER_UID, service
    assert checked == sum(len(spec.get("secrets", [])) for spec in services.values()) >= 7
    # Redis reads its password as root at start, then runs as the redis user (not root).
    status = stack.exec("redis", "cat", "/proc/1/status")
    uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
    assert uid == stack.exec("redis", "id", "-u", "redis").strip() != "0"


@pytest.mark.parametrize("service", ["router", "kvstore", "redis"])
def test_a_restart_mid_stream_breaks_no_stream(stack: ComposeStack, service: str) -> None:
    started_before = stack.inspect(service)["State"]["StartedAt"]
    timings: dict[str, float] = {}

    def restart() -> None:
        timings["restart began"] = time.monotonic()
        stack.compose("restart", service, timeout_s=120)
        timings["restart done"] = time.monotonic()

    restarter = AttackAt(restart)
    result = stream_story(stack.client(), STREAM_TOKENS, restarter)
    stream_ended = time.monotonic()
    restarter.join(120)
    assert not restarter.failures, restarter.failures
    assert_whole(result)
    assert stack.inspect(service)["State"]["StartedAt"] != started_before, f"{service} was not restarted"
    healthy_after = stack.wait_until(f"{service} healthy again", lambda: stack.healthy(service))
    print(
        f"\n{service}: `docker compose restart` took {timings['restart done'] - timings['restart began']:.1f} s, "
        f"the stream ended {stream_ended - timings['restart began']:.1f} s after it began; healthy "
        f"{healthy_after:.0f} s after the stream"
    )
    answered(stack)


def test_a_crashed_rank_restarts_by_its_policy_and_the_stream_is_answered(stack: ComposeStack) -> None:
    rank = "rank-worker-0"
    restarts_before = stack.inspect(rank)["RestartCount"]
    crashed: dict[str, float] = {}

    def crash(count: int, _message_id: str) -> None:
        if count == ATTACK_AT:
            stack.crash(rank)
            crashed["at"] = time.monotonic()

    result = stream_story(stack.client(), STREAM_TOKENS, crash)
    ended_after = time.monotonic() - crashed["at"]
    assert_whole(result)
    state = stack.inspect(rank)
    assert state["RestartCount"] == restarts_before + 1 and state["State"]["Running"], state["State"]
    assert continued_on(stack, rank, result.message_id)  # the restarted rank went on from the tokens sent
    print(f"\nrank crashed mid-stream: restarted by its policy; the stream ended {ended_after:.0f} s after the crash")
    stack.wait_until("the rank healthy again", lambda: stack.healthy(rank), timeout_s=240)
    answered(stack)


def test_docker_kill_is_a_manual_stop_and_the_stream_waits_for_compose_to_start_the_rank(
    stack: ComposeStack,
) -> None:
    rank = "rank-worker-0"
    restarts_before = stack.inspect(rank)["RestartCount"]
    seen: dict[str, Any] = {}

    def decided(container: dict[str, Any]) -> bool:
        """Docker decides on a restart as the container exits, in one step: "restarting" (Running stays true)
        with RestartCount up, or "exited" for good (moby's daemon/monitor.go, handleContainerExit)."""
        return container["State"]["Status"] == "exited" or container["RestartCount"] != restarts_before

    def operator() -> None:
        run(["docker", "kill", stack.container(rank)])
        stack.wait_until("Docker's restart decision on the killed rank", lambda: decided(stack.inspect(rank)), 30)
        seen["after kill"] = stack.inspect(rank)
        stack.up()  # what an operator runs: the stopped rank starts again, the rest is left as it is

    killer = AttackAt(operator)
    result = stream_story(stack.client(), STREAM_TOKENS, killer)
    killer.join(300)
    assert not killer.failures, killer.failures
    after_kill = seen["after kill"]
    assert not after_kill["State"]["Running"] and after_kill["RestartCount"] == restarts_before, after_kill["State"]
    assert_whole(result)
    assert continued_on(stack, rank, result.message_id)
    answered(stack)


def test_two_ranks_one_crashes_mid_stream_the_other_finishes_it(stack: ComposeStack) -> None:
    rendered = stack.render(ranks=2)
    limit = rendered["services"]["rank-worker-1"]["deploy"]["resources"]["limits"]["memory"]
    needed_gib = int(limit.removesuffix("m")) / 1024 + 1
    available_gib = _mem_available_gib()
    if available_gib < needed_gib:
        stack.render(ranks=1)
        pytest.skip(f"a second rank needs ~{needed_gib:.1f} GiB; {available_gib:.1f} GiB available")
    took = stack.up()
    print(f"\ndocker compose up, two ranks (rendered again with --ranks 2): healthy after {took:.0f} s")
    ranks = ("rank-worker-0", "rank-worker-1")
    restarts_before = {rank: stack.inspect(rank)["RestartCount"] for rank in ranks}
    crashed: dict[str, Any] = {}

    def crash_the_serving_rank(count: int, message_id: str) -> None:
        if count == ATTACK_AT:
            serving = [rank for rank in ranks if f"accepted request={message_id}" in stack.compose("logs", rank)]
            assert len(serving) == 1, serving
            stack.crash(serving[0])
            crashed.update(rank=serving[0], at=time.monotonic())

    result = stream_story(stack.client(), STREAM_TOKENS, crash_the_serving_rank)
    ended_after = time.monotonic() - crashed["at"]
    assert_whole(result)
    victim = crashed["rank"]
    survivor = next(rank for rank in ranks if rank != victim)
    assert stack.inspect(victim)["RestartCount"] == restarts_before[victim] + 1
    assert stack.inspect(survivor)["RestartCount"] == restarts_before[survivor]
    assert continued_on(stack, survivor, result.message_id)
    back_after = stack.wait_until(f"{victim} healthy again", lambda: stack.healthy(victim), timeout_s=240)
    print(
        f"\n{victim} crashed mid-stream: {survivor} finished the stream {ended_after:.1f} s after the crash; "
        f"{victim} restarted by its policy, healthy {back_after:.0f} s after the stream"
    )
    answered(stack)


def test_down_leaves_nothing(stack: ComposeStack) -> None:
    print(f"\nmemory, each service's limit and the peak its container reached:\n{stack.memory_report()}")
    stack.down()
    assert run(["docker", "ps", "-a", "-q"]).strip() == ""
    label = f"label=com.docker.compose.project={PROJECT}"
    assert run(["docker", "volume", "ls", "-q", "--filter", label]).strip() == ""
    assert run(["docker", "network", "ls", "-q", "--filter", label]).strip() == ""


def _mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024**2
    return 0.0
