"""The EPP as a real process in front of two real nodes (a rank worker with the embedded model and its gateway
each, on loopback), driven over ext_proc as Envoy drives it; each request it routes is then sent to the node it
chose, as Envoy would. The EPP learns what the nodes cache from their ranks' vLLM-format KV events and their
load from the ranks' /metrics.

Checked: a session sticks to its node; a new session whose prompt shares a long prefix with another's goes to the
node that holds it (the EPP's hashes equal the ranks'); distinct new sessions spread over both nodes; the body
comes back unchanged however Envoy splits it; bad input and no ready node get an ImmediateResponse in the API's
shape, quickly; a node whose gateway is killed stops being chosen, and its sessions go on elsewhere; gRPC health
tells liveness from readiness."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from ext_proc_client import process
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_processes import free_port, running_process, service_env, start_gateway, start_rank_worker

from launcher.health import wait_for_serving

MODEL = "default"  # the name every node gateway also accepts for its served model
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
MAX_BODY = 256 * 1024
CONTEXT = "4096"


@dataclass
class Node:
    name: str
    gateway_port: int
    gateway: subprocess.Popen[bytes]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.gateway_port}"


@dataclass
class Fleet:
    nodes: dict[str, Node]
    epp_address: str
    epp_log: Path

    def decisions(self, since: int = 0) -> list[dict[str, str]]:
        lines = self.epp_log.read_text(errors="replace")[since:].splitlines()
        return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines if "epp chose" in line]

    def log_size(self) -> int:
        return self.epp_log.stat().st_size

    def node_at(self, endpoint: str) -> Node:
        return next(node for node in self.nodes.values() if node.endpoint == endpoint)


@contextlib.contextmanager
def _node(tmp: Path, name: str) -> Iterator[tuple[Node, dict]]:
    rank_port, gateway_port, metrics_port = free_port(), free_port(), free_port()
    events, replay = free_port(), free_port()
    rank = {
        "KVSERVE_NUM_KV_BLOCKS": "512",
        "KVSERVE_MAX_MODEL_LEN": CONTEXT,
        "KVSERVE_MAX_NUM_SEQS": "4",
        "KVSERVE_RANK_ID": name,
        "KVSERVE_RANK_WORKER_METRICS_PORT": str(metrics_port),
        "KVSERVE_KV_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{events}",
        "KVSERVE_KV_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}",
    }
    with (
        start_rank_worker(tmp / f"{name}-rank.log", rank_port, **rank),
        start_gateway(tmp / f"{name}-gateway.log", gateway_port, [rank_port]) as gateway,
    ):
        spec = {
            "name": name,
            "endpoint": f"127.0.0.1:{gateway_port}",
            "metrics": [f"http://127.0.0.1:{metrics_port}/metrics"],
            "kv_events": [{"endpoint": f"tcp://127.0.0.1:{events}", "replay": f"tcp://127.0.0.1:{replay}"}],
        }
        yield Node(name, gateway_port, gateway), spec


@contextlib.contextmanager
def _epp(tmp: Path, name: str, nodes: list[dict], wait_ready: bool = True) -> Iterator[tuple[str, Path]]:
    port = free_port()
    fleet = {
        "listen": f"127.0.0.1:{port}",
        "policy": "prefix",
        "refresh_secs": 0.2,
        "node_timeout_secs": 1.0,
        "max_body_bytes": MAX_BODY,
        "nodes": nodes,
    }
    fleet_file = tmp / f"{name}.yaml"
    fleet_file.write_text(yaml.safe_dump(fleet))
    log = tmp / f"{name}.log"
    address = f"127.0.0.1:{port}"

    def ready(process: subprocess.Popen[bytes]) -> None:
        wait_for_serving(address, timeout_s=60, process=process, service=EXT_PROC if wait_ready else "")

    args = [sys.executable, "-m", "gateway.epp", "--fleet", str(fleet_file)]
    with running_process(args, service_env(), log, ready):
        yield address, log


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("epp")
    with (
        _node(tmp, "node-a") as (a, spec_a),
        _node(tmp, "node-b") as (b, spec_b),
        _epp(tmp, "epp", [spec_a, spec_b]) as (address, log),
    ):
        yield Fleet({"node-a": a, "node-b": b}, address, log)


def _messages(conversation: list[tuple[str, str]], max_tokens: int = 4) -> bytes:
    messages = [{"role": role, "content": text} for role, text in conversation]
    return json.dumps({"model": MODEL, "max_tokens": max_tokens, "messages": messages, "temperature": 0}).encode()


def _route_and_send(fleet: Fleet, body: bytes, session: str) -> tuple[Node, dict]:
    """Ask the EPP, then send the request to the node it named, as Envoy does; the node's JSON answer."""
    answer = process(fleet.epp_address, "/v1/messages", body, {"x-claude-code-session-id": session})
    assert answer.status == 0, answer.error
    assert answer.body == body and answer.body_ended
    assert answer.destination and answer.destination == answer.metadata_destination
    assert answer.clear_route_cache
    node = fleet.node_at(answer.destination)
    response = httpx.post(
        f"http://{node.endpoint}/v1/messages",
        content=body,
        headers={"content-type": "application/json", "x-claude-code-session-id": session},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return node, response.json()


def _text(words: int, seed: str) -> str:
    return " ".join(f"{seed}{i % 97}" for i in range(words))


def test_session_sticks_and_prefix_finds_its_node(fleet: Fleet) -> None:
    system = _text(400, "alpha")  # a long shared prefix: ~25 blocks of 16 tokens
    first = [("user", system + " question one")]
    node, reply = _route_and_send(fleet, _messages(first), "sticky-1")
    first_prompt = reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"]
    conversation = [*first, ("assistant", reply["content"][0]["text"] or "ok"), ("user", "and then?")]
    since = fleet.log_size()
    again, reply = _route_and_send(fleet, _messages(conversation), "sticky-1")
    assert again is node
    decision = fleet.decisions(since)[-1]
    assert decision["reason"] == "session" and decision["node"] == node.name
    assert int(decision["cached_tokens"]) > 300, decision  # the first turn's blocks, seen through the KV events
    # the node's cache served the whole previous prompt (but its last partial block and the lookup's last token)
    assert reply["usage"]["cache_read_input_tokens"] >= 0.95 * first_prompt, (reply["usage"], first_prompt)
    # A new session sharing the long prefix: the node that holds it, for its cache (not for a session)
    since = fleet.log_size()
    other, _ = _route_and_send(fleet, _messages([("user", system + " another question")]), "sticky-2")
    decision = fleet.decisions(since)[-1]
    assert other is node and decision["reason"] == "prefix", decision
    assert int(decision["cached_tokens"]) >= 16 * 20


def test_new_sessions_spread_over_nodes(fleet: Fleet) -> None:
    used = set()
    for n in range(6):
        answer = process(
            fleet.epp_address,
            "/v1/messages",
            _messages([("user", _text(60, f"spread{n}x"))]),
            {"x-claude-code-session-id": f"spread-{n}"},
        )
        assert answer.status == 0, answer.error
        used.add(answer.destination)
    assert used == {node.endpoint for node in fleet.nodes.values()}


def test_body_comes_back_whole_in_any_pieces(fleet: Fleet) -> None:
    body = _messages([("user", _text(700, "piece"))])
    for piece in (100, 777, 4096, len(body)):
        answer = process(fleet.epp_address, "/v1/messages", body, piece_bytes=piece)
        assert answer.status == 0 and answer.body == body and answer.body_ended


def test_openai_path_and_bodyless_requests_are_routed(fleet: Fleet) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    answer = process(fleet.epp_address, "/v1/chat/completions", body, {"x-session-id": "openai-1"})
    assert answer.status == 0 and answer.body == body and answer.destination
    models = process(fleet.epp_address, "/v1/models", None)
    assert models.status == 0 and models.destination in {node.endpoint for node in fleet.nodes.values()}
    assert models.body == b""


@pytest.mark.parametrize(
    ("path", "body", "status", "shape", "words"),
    [
        ("/v1/messages", b"{not json", 400, "anthropic", "JSON"),
        ("/v1/messages", json.dumps({"max_tokens": 5, "messages": []}).encode(), 400, "anthropic", "model"),
        (
            "/v1/messages",
            json.dumps(
                {"model": "no-such-model", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
            ).encode(),
            400,
            "anthropic",
            "available models",
        ),
        ("/v1/chat/completions", b"[1, 2]", 400, "openai", "JSON object"),
        ("/v1/messages", b'{"model": "' + b"x" * (MAX_BODY + 10) + b'"}', 413, "anthropic", "too large"),
    ],
)
def test_bad_input_gets_an_immediate_response_in_the_apis_shape(
    fleet: Fleet, path: str, body: bytes, status: int, shape: str, words: str
) -> None:
    started = time.monotonic()
    answer = process(fleet.epp_address, path, body, timeout_s=10)
    assert time.monotonic() - started < 5
    assert answer.status == status and not answer.destination
    assert answer.immediate_headers["content-type"] == "application/json"
    if shape == "anthropic":
        assert answer.error["type"] == "error" and words in answer.error["error"]["message"], answer.error
    else:
        assert words in answer.error["error"]["message"], answer.error


def test_health_liveness_and_readiness(fleet: Fleet) -> None:
    with grpc.insecure_channel(fleet.epp_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", EXT_PROC):
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_no_ready_node_is_a_quick_503(tmp_path: Path) -> None:
    dead = {"name": "gone", "endpoint": f"127.0.0.1:{free_port()}"}
    with _epp(tmp_path, "lonely", [dead], wait_ready=False) as (address, _):
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=EXT_PROC), timeout=5
            )
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        answer = process(address, "/v1/messages", _messages([("user", "hello")]), timeout_s=10)
        assert answer.status == 503 and answer.error["error"]["type"] == "api_error"
        assert answer.immediate_headers.get("retry-after") == "5"


def test_a_killed_node_is_left_and_its_sessions_go_on_elsewhere(fleet: Fleet) -> None:
    # last in this module: it kills one node's gateway
    body = _messages([("user", _text(200, "killed"))])
    node, _ = _route_and_send(fleet, body, "moving-1")
    survivor = next(other for other in fleet.nodes.values() if other is not node)
    node.gateway.send_signal(signal.SIGKILL)
    node.gateway.wait(timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # until the EPP's poll has seen the node go
        answer = process(fleet.epp_address, "/v1/messages", body, {"x-claude-code-session-id": "moving-1"})
        if answer.destination == survivor.endpoint:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the EPP still sends the session to its killed node")
    for n in range(4):  # every request after that goes to the survivor, and is served there
        moved, _ = _route_and_send(fleet, _messages([("user", _text(50, f"after{n}y"))]), f"after-{n}")
        assert moved is survivor
    again, reply = _route_and_send(fleet, body, "moving-1")
    assert again is survivor and reply["usage"]["output_tokens"] > 0
