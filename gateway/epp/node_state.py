"""What the EPP knows of each node besides its cache: ready or not, the model it serves, its load.

A node is ready while its gateway answers /ready and the EPP holds its model info (gateway /kvserve/model-info:
the tokenizer, template and block hashing of its ranks, so the EPP computes a prompt's block hashes as the node's
gateway does). Load is read from its ranks' /metrics, by vLLM's names plus kvserve:waiting_prefill_tokens; what
the EPP sent since that read is added, so a burst of requests between two reads does not all pick one node.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from contracts.address import split_host_port
from contracts.service_main import listen_address
from gateway.epp.fleet_config import NodeSpec
from gateway.http.app import MODEL_INFO_PATH
from protos import rank_worker_pb2 as pb

log = logging.getLogger(__name__)

_LOAD_METRICS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "kvserve:waiting_prefill_tokens": "waiting_prefill_tokens",
}


@dataclass
class NodeLoad:
    ranks: int = 0  # ranks whose /metrics answered
    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0


@dataclass
class NodeState:
    spec: NodeSpec
    ready: bool = False
    info: pb.ModelInfoResponse | None = None
    load: NodeLoad = field(default_factory=NodeLoad)
    sent_prefill_tokens: int = 0  # chosen for this node since its load was read
    sent_requests: int = 0
    failure: str = "not polled yet"
    ready_since: float = 0.0
    destination: str = ""  # ip:port of its gateway (the endpoint's name resolved): what Envoy's header needs

    def __post_init__(self) -> None:
        host, port = split_host_port(self.spec.endpoint)
        if _is_ip(host):
            self.destination = listen_address(host, port)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def queued_prefill_tokens(self) -> int:
        return self.load.waiting_prefill_tokens + self.sent_prefill_tokens

    @property
    def running(self) -> int:
        return self.load.running + self.load.waiting + self.sent_requests

    @property
    def ranks(self) -> int:
        return max(1, self.load.ranks)

    def sent(self, new_prefill_tokens: int) -> None:
        self.sent_prefill_tokens += max(0, new_prefill_tokens)
        self.sent_requests += 1


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolved(endpoint: str) -> str:
    """host:port with the host resolved to an address (Envoy's ORIGINAL_DST cluster takes an address, while a
    fleet file may name nodes by DNS, as a Kubernetes StatefulSet's pods are); read again on every poll, so a
    pod that comes back at another address is followed."""
    host, port = split_host_port(endpoint)
    if _is_ip(host):
        return listen_address(host, port)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host} does not resolve")
    ipv4 = [info for info in infos if info[0] == socket.AF_INET]
    return listen_address(str((ipv4 or infos)[0][4][0]), port)


def parse_load(texts: list[str]) -> NodeLoad:
    load = NodeLoad()
    for text in texts:
        load.ranks += 1
        for family in text_string_to_metric_families(text):
            attribute = _LOAD_METRICS.get(family.name)
            if attribute is None:
                continue
            total = sum(sample.value for sample in family.samples if sample.name == family.name)
            setattr(load, attribute, getattr(load, attribute) + int(total))
    return load


class NodePoller:
    """Reads one node every refresh_secs, until cancelled."""

    def __init__(
        self,
        state: NodeState,
        client: httpx.AsyncClient,
        refresh_s: float,
        api_key: str = "",
        on_back: Callable[[], None] | None = None,
    ) -> None:
        self.state = state
        self._on_back = on_back  # called when the node is ready again after it was not
        self._client = client
        self._refresh_s = refresh_s
        self._headers = {"x-api-key": api_key} if api_key else {}

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self._refresh_s)

    async def poll(self) -> None:
        state = self.state
        base = f"http://{state.spec.endpoint}"
        try:
            response = await self._client.get(base + "/ready")
            if response.status_code != 200:
                self._down(f"/ready answered {response.status_code}")
                return
            if state.info is None or not state.ready:
                response = await self._client.get(base + MODEL_INFO_PATH, headers=self._headers)
                if response.status_code != 200:
                    self._down(f"{MODEL_INFO_PATH} answered {response.status_code}")
                    return
                info = pb.ModelInfoResponse()
                info.ParseFromString(response.content)
                state.info = info
            state.destination = await resolved(state.spec.endpoint)
            texts = await self._metrics()
        except (httpx.HTTPError, OSError, ValueError) as exc:
            self._down(f"{type(exc).__name__}: {exc}")
            return
        state.load = parse_load(texts)
        state.sent_prefill_tokens = 0
        state.sent_requests = 0
        if not state.ready:
            log.info(
                "node %s is ready (%s, %d ranks reporting)", state.name, state.info.served_model_name, state.load.ranks
            )
            if state.ready_since and self._on_back is not None:
                self._on_back()
            state.ready_since = time.monotonic()
        state.ready = True
        state.failure = ""

    async def _metrics(self) -> list[str]:
        texts = []
        for url in self.state.spec.metrics:
            try:
                response = await self._client.get(url)
            except httpx.HTTPError as exc:
                log.debug("node %s: %s: %s", self.state.name, url, exc)
                continue
            if response.status_code == 200:
                texts.append(response.text)
        return texts

    def _down(self, why: str) -> None:
        state = self.state
        if state.ready:
            log.warning("node %s is not ready: %s", state.name, why)
        state.ready = False
        state.failure = why
