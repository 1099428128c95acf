"""The EPP's fleet file: where it listens, how it chooses, and the nodes it chooses among.

A node is one kvserve stack (gateway, router, ranks, one L1): the EPP sends a request to its gateway
(`endpoint`, what Envoy forwards to), reads its load from its ranks' /metrics (vLLM's names) and follows what its
ranks and its kvstore cache through their KV events in vLLM's format. Nodes are listed, not discovered: in
Kubernetes the Helm chart renders one entry per pod of the nodes' StatefulSet (deploy/helm/kvserve).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from contracts.address import split_host_port
from contracts.config import DEFAULTS
from gateway.epp.node_choice import NODE_CHOICES

# Envoy's ORIGINAL_DST cluster and the Gateway API Inference Extension read the chosen endpoint here
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_METADATA_NAMESPACE = "envoy.lb"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KvEventSource(_Strict):
    endpoint: str = Field(description="a publisher's ZMQ PUB socket: a rank's (medium GPU) or the kvstore's (CPU)")
    replay: str = Field("", description="its replay socket (ZMQ ROUTER); empty: gaps are not filled")
    topic: str = Field("", description="the topic its batches carry (the node's kv_events_topic)")


class NodeSpec(_Strict):
    name: str = Field(min_length=1, max_length=128)
    endpoint: str = Field(description="host:port of the node's gateway")
    metrics: list[str] = Field(default_factory=list, description="its ranks' /metrics URLs (load)")
    kv_events: list[KvEventSource] = Field(default_factory=list)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        split_host_port(value)  # ValueError when it is not host:port
        return value


class FleetConfig(_Strict):
    listen: str = Field("0.0.0.0:9002", description="the ext_proc gRPC server (and grpc.health.v1 on it)")
    health_listen: str = Field("", description="grpc.health.v1 alone, for Kubernetes' probes; empty: off")
    metrics_listen: str = Field("", description="the EPP's own /metrics (HTTP); empty: off")
    policy: str = Field("prefix", description="prefix | round_robin | least_loaded (gateway/epp/node_choice.py)")
    refresh_secs: float = Field(0.5, gt=0.0, description="how often each node's readiness and load are read")
    node_timeout_secs: float = Field(2.0, gt=0.0, description="a node's /ready or /metrics slower than this fails")
    node_api_key_file: str = Field(
        "", description="a gateway key with the metrics scope, for nodes whose gateways require keys (model info)"
    )
    max_body_bytes: int = Field(DEFAULTS.max_request_bytes, gt=0, description="a larger request body gets a 413")
    shed_prefill_tokens: int = Field(
        0,
        ge=0,
        description="refuse (429) a request when every ready node has at least this much prefill queued per "
        "rank; 0: never shed, queue instead",
    )
    sessions: int = Field(100_000, gt=0, description="sessions whose node the EPP remembers (least recent dropped)")
    l1_restore_cost: float = Field(DEFAULTS.scheduling.l1_restore_cost, ge=0.0)
    overload_prefill_tokens: int = Field(DEFAULTS.overload_prefill_tokens, gt=0)
    nodes: list[NodeSpec] = Field(min_length=1)

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in NODE_CHOICES:
            raise ValueError(f"policy {value!r}: one of {', '.join(NODE_CHOICES)}")
        return value

    @field_validator("nodes")
    @classmethod
    def _unique(cls, nodes: list[NodeSpec]) -> list[NodeSpec]:
        for attribute in ("name", "endpoint"):
            values = [getattr(node, attribute) for node in nodes]
            repeated = sorted({value for value in values if values.count(value) > 1})
            if repeated:
                raise ValueError(f"two nodes with one {attribute}: {', '.join(repeated)}")
        return nodes

    def node_api_key(self) -> str:
        return Path(self.node_api_key_file).read_text().strip() if self.node_api_key_file else ""


def load_fleet(path: str | Path) -> FleetConfig:
    with open(path) as handle:
        document = yaml.safe_load(handle)
    if not isinstance(document, dict):
        raise ValueError(f"{path}: a fleet file is a YAML mapping")
    return FleetConfig.model_validate(document)
