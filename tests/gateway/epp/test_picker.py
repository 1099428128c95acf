"""The EPP's decision on the live fleet state (gateway/epp/picker.py) where no prompt is read (a path that is not
a chat endpoint): ready nodes only, 503 with none, 429 when every node is past the shedding bar, the least
loaded otherwise, what was sent since the last load read counted; and the ext_proc body answers' pieces."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.epp.ext_proc import BODY_PIECE_BYTES, ExtProcServicer, body_responses
from gateway.epp.fleet_config import FleetConfig, NodeSpec
from gateway.epp.fleet_index import FleetIndex
from gateway.epp.node_state import NodeLoad, NodeState, parse_load, resolved
from gateway.epp.picker import Picker, ReadRequest, Refusal
from protos import rank_worker_pb2 as pb

NO_PROMPT = ReadRequest("", "", {}, {})


def _fleet(shed: int = 0, names: tuple[str, ...] = ("a", "b")) -> tuple[Picker, dict[str, NodeState]]:
    specs = [NodeSpec(name=name, endpoint=f"127.0.0.1:{9000 + n}") for n, name in enumerate(names)]
    config = FleetConfig(nodes=specs, shed_prefill_tokens=shed)
    nodes = {spec.name: NodeState(spec) for spec in specs}
    for node in nodes.values():
        node.ready = True
        node.info = pb.ModelInfoResponse(served_model_name="m", block_size=16)
        node.load = NodeLoad(ranks=1)
    return Picker(config, list(nodes.values()), FleetIndex()), nodes


def test_only_ready_nodes_and_503_without_any() -> None:
    picker, nodes = _fleet()
    nodes["a"].ready = False
    for _ in range(3):
        assert picker.choose(NO_PROMPT, "/v1/models").node is nodes["b"]
    nodes["b"].ready = False
    with pytest.raises(Refusal) as refused:
        picker.choose(NO_PROMPT, "/v1/models")
    assert refused.value.error.status == 503 and refused.value.error.retry_after_s


def test_least_loaded_counts_what_was_sent_since_the_last_read() -> None:
    picker, nodes = _fleet()
    nodes["a"].load = NodeLoad(ranks=1, waiting_prefill_tokens=5000)
    assert picker.choose(NO_PROMPT, "/v1/models").node is nodes["b"]
    nodes["b"].sent(8000)  # requests chosen for b since its load was read
    assert picker.choose(NO_PROMPT, "/v1/models").node is nodes["a"]


def test_shedding_only_when_every_node_is_past_the_bar() -> None:
    picker, nodes = _fleet(shed=10_000)
    nodes["a"].load = NodeLoad(ranks=2, waiting_prefill_tokens=30_000)  # 15K a rank
    assert picker.choose(NO_PROMPT, "/v1/models").node is nodes["b"]
    nodes["b"].load = NodeLoad(ranks=1, waiting_prefill_tokens=10_000)
    with pytest.raises(Refusal) as refused:
        picker.choose(NO_PROMPT, "/v1/models")
    assert refused.value.error.status == 429


def test_load_parsed_from_rank_metrics() -> None:
    text = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n'
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 2.0\n'
        '# TYPE kvserve:waiting_prefill_tokens gauge\nkvserve:waiting_prefill_tokens{model_name="m"} 1500.0\n'
    )
    load = parse_load([text, text])
    assert (load.ranks, load.running, load.waiting, load.waiting_prefill_tokens) == (2, 6, 4, 3000)


@pytest.mark.parametrize("size", [0, 1, BODY_PIECE_BYTES, BODY_PIECE_BYTES + 1, 3 * BODY_PIECE_BYTES + 17])
def test_body_answers_carry_the_body_in_pieces(size: int) -> None:
    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    answers = body_responses(body)
    pieces = [answer.request_body.response.body_mutation.streamed_response for answer in answers]
    assert b"".join(piece.body for piece in pieces) == body
    assert all(len(piece.body) <= BODY_PIECE_BYTES for piece in pieces)
    assert [piece.end_of_stream for piece in pieces] == [False] * (len(pieces) - 1) + [True]


def test_a_node_named_by_dns_is_sent_to_by_address() -> None:
    # Envoy's ORIGINAL_DST cluster takes an address: a fleet file's DNS names (a StatefulSet's pods) are resolved
    # (only names /etc/hosts answers: a test sends no DNS query off this machine)
    assert asyncio.run(resolved("localhost:8080")) in ("127.0.0.1:8080", "[::1]:8080")
    assert asyncio.run(resolved("10.1.2.3:8080")) == "10.1.2.3:8080"
    assert NodeState(NodeSpec(name="n", endpoint="10.1.2.3:8080")).destination == "10.1.2.3:8080"
    assert NodeState(NodeSpec(name="n", endpoint="node-0.nodes.ns.svc:8080")).destination == ""  # until polled


def test_a_fault_of_the_epps_own_is_that_requests_500_in_its_apis_shape() -> None:
    picker, _ = _fleet()

    def broken() -> list:
        raise RuntimeError("a bug")

    picker.prompters = broken  # type: ignore[method-assign]
    outcomes: list[str] = []
    servicer = ExtProcServicer(picker, 1024, lambda decision, outcome, seconds: outcomes.append(outcome))
    [answer] = asyncio.run(servicer._decide({":path": "/v1/chat/completions"}, b"{}"))
    immediate = answer.immediate_response
    assert immediate.status.code == 500 and outcomes == ["500"]
    error = json.loads(immediate.body)["error"]
    assert error["type"] == "api_error" and "a bug" not in error["message"]  # OpenAI's shape, no internals
