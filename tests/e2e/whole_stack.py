"""The whole stack as real processes for end-to-end tests: redis-server, kvstore, router, rank workers and the
gateway, each on a free loopback port, each one killable and restartable on its own (same port, same
settings), as a failure test needs."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from service_processes import ROOT, free_port, redis_server_args, service_env, wait_http_ready, wait_redis_ready

from contracts import internal_auth
from launcher.health import wait_for_serving
from protos import kvstore_pb2, kvstore_pb2_grpc, rank_worker_pb2, rank_worker_pb2_grpc, router_pb2, router_pb2_grpc

READY_TIMEOUT_S = 180


@dataclass
class Service:
    name: str
    args: list[str]
    env: dict[str, str]
    port: int
    wait_ready: Callable[[subprocess.Popen[bytes]], None]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    metrics_port: int = 0  # its Prometheus /metrics (kvstore, router, ranks; the gateway's is on its own port)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start {self.starts} =====\n".encode())
            log.flush()
            self.process = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready(self.process)
        except Exception:
            print(self.log_tail())
            raise

    def kill(self, sig: signal.Signals = signal.SIGKILL, timeout_s: float = 30) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        return f"--- {self.name} log ---\n" + self.log_path.read_text(errors="replace")[-chars:]


@dataclass
class Stack:
    tmp: Path
    services: dict[str, Service] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.services['gateway'].port}"

    def rank_names(self) -> list[str]:
        return [name for name in self.services if name.startswith("rank-")]

    def __getitem__(self, name: str) -> Service:
        return self.services[name]

    def stop_all(self) -> None:
        for service in reversed(list(self.services.values())):
            service.kill(signal.SIGTERM)

    # --- reading state over the services' own RPCs ---

    def rank_stats(self, name: str) -> rank_worker_pb2.StatsResponse:
        with internal_auth.channel(self.services[name].address) as channel:
            return rank_worker_pb2_grpc.RankWorkerStub(channel).Stats(rank_worker_pb2.StatsRequest(), timeout=10)

    def kvstore_stats(self) -> kvstore_pb2.StatsResponse:
        with internal_auth.channel(self.services["kvstore"].address) as channel:
            return kvstore_pb2_grpc.KvStoreStub(channel).Stats(kvstore_pb2.StatsRequest(), timeout=10)

    def holds_nothing(self) -> bool:
        """No request left in any rank, every L0 pool free, no L1 copy in flight, no L1 slot pinned or half
        written: what a stack must come back to once its clients are gone, whatever they did."""
        ranks = [self.rank_stats(name) for name in self.rank_names()]
        l1 = self.kvstore_stats()
        return (
            all(r.running == 0 and r.waiting == 0 and r.used_blocks == 0 for r in ranks)
            and all(r.free_blocks == r.total_blocks and r.l1_copies_in_flight == 0 for r in ranks)
            and l1.pinned_slots == 0
            and l1.writing_slots == 0
        )

    def router_ranks(self) -> router_pb2.ListRanksResponse:
        with internal_auth.channel(self.services["router"].address) as channel:
            return router_pb2_grpc.RouterStub(channel).ListRanks(router_pb2.ListRanksRequest(), timeout=10)

    def scrape(self, name: str) -> dict[str, Any]:
        """A service's /metrics, parsed: family name -> family (the gateway's from its own port)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        service = self.services[name]
        port = service.port if name == "gateway" else service.metrics_port
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return {family.name: family for family in text_string_to_metric_families(text)}

    def wait_until(self, what: str, check: Callable[[], bool], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                if check():
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{what}: not true after {timeout_s} s")

    def wait_ranks_healthy(self, count: int, timeout_s: float = 60) -> None:
        self.wait_until(
            f"{count} healthy ranks at the router",
            lambda: sum(r.healthy for r in self.router_ranks().ranks) == count,
            timeout_s,
        )

    def wait_no_load_at_router(self, timeout_s: float = 60) -> None:
        """Every rank idle at the router with (next to) no prefill load counted: a 2-token prompt straight
        to each, then a heartbeat from each after it, until the router sees nothing running or waiting anywhere
        and no more prefill load than those 2 tokens. (A rank reports the prefill load it last measured, at most
        every 0.5 s and only while it steps: an idle rank keeps reporting its last request's, however large,
        until it steps again.)"""
        touch_tokens = 2

        def no_load() -> bool:
            touch_ranks(self, tokens=touch_tokens)
            touched = time.monotonic()
            self.wait_until(
                "a heartbeat from every rank after a prompt sent to it",
                lambda: all(time.monotonic() - r.last_heartbeat_age_s > touched for r in self.router_ranks().ranks),
                timeout_s=10,
            )
            return all(
                r.load.running == 0 and r.load.waiting == 0 and r.load.waiting_prefill_tokens <= touch_tokens
                for r in self.router_ranks().ranks
            )

        self.wait_until("no load at the router", no_load, timeout_s)

    def wait_l1_attached(self, timeout_s: float = 90) -> None:
        """Every live rank attached to the kvstore's arena and writing to it. A rank notices a new arena (a
        restarted kvstore) on its next use of L1: a short prompt to each, until all have attached."""

        def attached() -> bool:
            touch_ranks(self)
            ranks = [name for name in self.rank_names() if self[name].alive()]
            return self.kvstore_stats().stored_slots > 0 and all(self.rank_stats(name).l1_attached for name in ranks)

        self.wait_until("every rank attached to the kvstore's arena and writing to it", attached, timeout_s)

    def route_fields(self, session: str, since: int, timeout_s: float = 30) -> dict[str, str]:
        """The fields of the router's route line (rank, reason, prompt, l0, l1, ...) for the first request of
        `session` it routed after byte offset `since` of its log, waited for: the line is written as the
        router answers, and the file may lag the answer."""
        log_path = self.services["router"].log_path
        line = re.compile(rf"\broute request=\S+ session={re.escape(session)} .*")
        deadline = time.monotonic() + timeout_s
        while True:
            with log_path.open("rb") as log:
                log.seek(since)
                text = log.read().decode(errors="replace")
            match = line.search(text)
            if match:
                return dict(re.findall(r"(\w+)=(\S+)", match.group(0)))
            assert time.monotonic() < deadline, f"no route line for session {session!r} in: {text[-3000:]}"
            time.sleep(0.1)

    def log_size(self, name: str) -> int:
        """Where the service's log ends now: what a later read starts from."""
        return self.services[name].log_path.stat().st_size


def _grpc_ready(port: int) -> Callable[[subprocess.Popen[bytes]], None]:
    return lambda process: wait_for_serving(f"127.0.0.1:{port}", timeout_s=READY_TIMEOUT_S, process=process)


@contextlib.contextmanager
def whole_stack(
    tmp: Path,
    ranks: int = 2,
    rank_settings: dict[str, str] | None = None,
    gateway_settings: dict[str, str] | None = None,
    router_settings: dict[str, str] | None = None,
    l1_host_gb: str = "0.25",
    gateway: bool = True,
) -> Iterator[Stack]:
    """Start redis-server, kvstore, router, `ranks` rank workers and the gateway; stop them all at the end."""
    stack = Stack(tmp)
    ports = {name: free_port() for name in ("redis", "kvstore", "router", "gateway")}
    rank_ports = [free_port() for _ in range(ranks)]
    metrics_ports = {name: free_port() for name in ("kvstore", "router", *(f"rank-{i}" for i in range(ranks)))}
    kvstore_address = f"127.0.0.1:{ports['kvstore']}"
    router_address = f"127.0.0.1:{ports['router']}"
    common = {"KVSERVE_KVSTORE": kvstore_address, "KVSERVE_ROUTER": router_address}
    python = sys.executable
    redis_dir = tmp / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)

    def add(name: str, args: list[str], env: dict[str, str], port: int, ready) -> None:
        metrics_port = metrics_ports.get(name, 0)
        stack.services[name] = Service(name, args, env, port, ready, tmp / f"{name}.log", metrics_port=metrics_port)

    redis_args = redis_server_args(ports["redis"], redis_dir)
    add("redis", redis_args, service_env(), ports["redis"], lambda p: wait_redis_ready(ports["redis"], p))
    add(
        "kvstore",
        [python, "-m", "kvstore", "--port", str(ports["kvstore"])],
        service_env(
            KVSERVE_L1_HOST_GB=l1_host_gb,
            KVSERVE_L1_ARENA_DIR=str(_arena_dir(tmp)),
            KVSERVE_L1_HEADROOM_GB="0",
            KVSERVE_KVSTORE_METRICS_PORT=str(metrics_ports["kvstore"]),
        ),
        ports["kvstore"],
        _grpc_ready(ports["kvstore"]),
    )
    add(
        "router",
        [python, "-m", "router", "--port", str(ports["router"])],
        service_env(
            **{
                "KVSERVE_REDIS_URL": f"redis://127.0.0.1:{ports['redis']}/0",
                "KVSERVE_KVSTORE": kvstore_address,
                "KVSERVE_HEARTBEAT_INTERVAL_SECS": "0.5",
                "KVSERVE_RANK_DOWN_AFTER_SECS": "3",
                "KVSERVE_ROUTER_METRICS_PORT": str(metrics_ports["router"]),
                **(router_settings or {}),  # may override the above
            }
        ),
        ports["router"],
        _grpc_ready(ports["router"]),
    )
    for index, port in enumerate(rank_ports):
        add(
            f"rank-{index}",
            [python, "-m", "rank_worker", "--port", str(port)],
            service_env(
                **{
                    "KVSERVE_RANK_ID": f"rank-{index}",
                    "KVSERVE_HEARTBEAT_INTERVAL_SECS": "0.5",
                    "KVSERVE_RANK_WORKER_METRICS_PORT": str(metrics_ports[f"rank-{index}"]),
                    **common,
                    **(rank_settings or {}),  # may override the above
                }
            ),
            port,
            _grpc_ready(port),
        )
    if gateway:
        add(
            "gateway",
            [python, "-m", "gateway", "--port", str(ports["gateway"])],
            service_env(
                KVSERVE_ROUTER=router_address,
                KVSERVE_RANK_WORKERS=json.dumps([f"127.0.0.1:{p}" for p in rank_ports]),
                **(gateway_settings or {}),
            ),
            ports["gateway"],
            lambda p: wait_http_ready(f"http://127.0.0.1:{ports['gateway']}/ready", p, READY_TIMEOUT_S),
        )
    try:
        for service in stack.services.values():
            service.start()
        stack.wait_ranks_healthy(ranks)
        yield stack
    except Exception:
        for service in stack.services.values():
            if not service.alive():
                print(service.log_tail())
        raise
    finally:
        stack.stop_all()


def _arena_dir(tmp: Path) -> Path:
    """The test's own directory: parallel test stacks never see each other's arenas (production uses
    /dev/shm; the copy path is the same for any shared file mapping)."""
    path = tmp / "l1"
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- clients of the stack, as a test drives it ---


def chat_turn(
    url: str, session: str, messages: list[dict], max_tokens: int = 8, timeout_s: float = 180
) -> tuple[str, dict]:
    """One greedy /v1/messages call for a session; returns the reply text and the usage."""
    import httpx

    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "messages": messages}
    response = httpx.post(
        f"{url}/v1/messages", json=body, headers={"x-claude-code-session-id": session}, timeout=timeout_s
    )
    assert response.status_code == 200, response.text
    data = response.json()
    return "".join(block.get("text", "") for block in data["content"]), data["usage"]


def cached_tokens_metric(url: str) -> dict[str, float]:
    """The gateway's cumulative cached prompt tokens per tier (l0, l1), from /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    tiers: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "kvserve_gateway_cached_tokens_total":
                tiers[sample.labels["tier"]] = sample.value
    return tiers


def finished_per_rank(stack: Stack) -> dict[str, int]:
    return {name: stack.rank_stats(name).finished_requests for name in stack.rank_names() if stack[name].alive()}


def served_by(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The ranks whose finished count grew between two readings."""
    return [name for name in after if after[name] > before.get(name, 0)]


def touch_ranks(stack: Stack, tokens: int = 40) -> None:
    """A short fresh prompt straight to every live rank: each looks it up in L1 and writes it there."""
    import random

    for name in stack.rank_names():
        if not stack[name].alive():
            continue
        request = rank_worker_pb2.GenerateRequest(
            prompt_token_ids=[random.randrange(1000, 40000) for _ in range(tokens)],
            sampling=rank_worker_pb2.SamplingParams(temperature=0, max_tokens=1),
        )
        with internal_auth.channel(stack[name].address) as channel:
            for _ in rank_worker_pb2_grpc.RankWorkerStub(channel).Generate(request, timeout=120):
                pass


def evict_l0(stack: Stack, seed: int, max_tokens: int = 1900) -> None:
    """Fill every live rank's L0 pool with a fresh prompt sent straight to it, so whatever it cached before
    is evicted (its blocks stay in L1 when they were written there)."""
    import random

    rng = random.Random(seed)
    for name in stack.rank_names():
        if not stack[name].alive():
            continue
        stats = stack.rank_stats(name)
        tokens = min((stats.total_blocks - 4) * stats.block_size, max_tokens)
        request = rank_worker_pb2.GenerateRequest(
            prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(tokens)],
            sampling=rank_worker_pb2.SamplingParams(temperature=0, max_tokens=1),
        )
        with internal_auth.channel(stack[name].address) as channel:
            for _ in rank_worker_pb2_grpc.RankWorkerStub(channel).Generate(request, timeout=300):
                pass


def stream_message(
    url: str,
    body: dict,
    headers: dict[str, str] | None = None,
    on_delta: Callable[[int], None] | None = None,
    timeout_s: float = 120,
) -> tuple[list[str], str, dict]:
    """Stream /v1/messages; on_delta(count) after each text delta. Returns event names, text, last data
    (the message_delta or error event)."""
    import httpx

    names: list[str] = []
    text: list[str] = []
    last: dict = {}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, headers=headers, timeout=timeout_s) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if data.get("type") == "content_block_delta":
                    text.append(data["delta"].get("text", ""))
                    if on_delta is not None:
                        on_delta(len(text))
                if data.get("type") in ("message_delta", "error"):
                    last = data
    return names, "".join(text), last
