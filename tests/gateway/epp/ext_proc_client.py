"""Drives the EPP's ext_proc stream as Envoy does in FULL_DUPLEX_STREAMED mode: the request's headers, then its
body in pieces, and reads back the answers: the destination header and dynamic metadata, the body streamed back,
or an ImmediateResponse. (The real Envoy in front of the EPP is tested in tests/fleet/.)"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import json_format

from gateway.epp.fleet_config import DESTINATION_HEADER, DESTINATION_METADATA_NAMESPACE


@dataclass
class Answer:
    destination: str = ""  # the header the EPP set
    metadata_destination: str = ""  # the same under envoy.lb
    clear_route_cache: bool = False
    body: bytes = b""  # the body as streamed back
    body_ended: bool = False
    status: int = 0  # an ImmediateResponse's status, 0 for none
    error: dict[str, Any] = field(default_factory=dict)  # its JSON body
    immediate_headers: dict[str, str] = field(default_factory=dict)


def process(
    address: str,
    path: str,
    body: bytes | None,
    headers: dict[str, str] | None = None,
    piece_bytes: int = 4096,
    timeout_s: float = 30,
) -> Answer:
    pairs = {":method": "POST" if body is not None else "GET", ":path": path, "content-type": "application/json"}
    pairs.update(headers or {})
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=key, raw_value=value.encode()) for key, value in pairs.items()]
    )
    messages = [ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map, end_of_stream=body is None))]
    if body is not None:
        pieces = [body[i : i + piece_bytes] for i in range(0, len(body), piece_bytes)] or [b""]
        for n, piece in enumerate(pieces):
            end = n == len(pieces) - 1
            messages.append(ep.ProcessingRequest(request_body=ep.HttpBody(body=piece, end_of_stream=end)))
    answer = Answer()
    with grpc.insecure_channel(address) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for response in stub.Process(iter(messages), timeout=timeout_s):
            kind = response.WhichOneof("response")
            if kind == "request_headers":
                common = response.request_headers.response
                answer.clear_route_cache = common.clear_route_cache
                for option in common.header_mutation.set_headers:
                    if option.header.key == DESTINATION_HEADER:
                        answer.destination = option.header.raw_value.decode()
                metadata = json_format.MessageToDict(response.dynamic_metadata)
                answer.metadata_destination = metadata.get(DESTINATION_METADATA_NAMESPACE, {}).get(
                    DESTINATION_HEADER, ""
                )
                if body is None:
                    break
            elif kind == "request_body":
                streamed = response.request_body.response.body_mutation.streamed_response
                answer.body += streamed.body
                if streamed.end_of_stream:
                    answer.body_ended = True
                    break
            elif kind == "immediate_response":
                immediate = response.immediate_response
                answer.status = immediate.status.code
                answer.error = json.loads(immediate.body)
                answer.immediate_headers = {
                    option.header.key: option.header.raw_value.decode() for option in immediate.headers.set_headers
                }
                break
    return answer
