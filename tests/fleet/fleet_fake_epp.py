"""A stand-in EPP for testing Envoy's configuration alone: an ext_proc server (envoy.service.ext_proc.v3) that
speaks FULL_DUPLEX_STREAMED as the real one does (headers answered once the body is in, then the body streamed
back) and chooses the endpoint a request names in `x-test-pick` (an index, or "none" for no choice), else round
robin. In-process, on loopback."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.epp.envoy_config import EXT_PROC_SERVICE
from gateway.epp.fleet_config import DESTINATION_HEADER

PICK_HEADER = "x-test-pick"
OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.Value("OVERWRITE_IF_EXISTS_OR_ADD")


class FakeEpp(ep_grpc.ExternalProcessorServicer):
    def __init__(self, endpoints: Sequence[str]) -> None:
        self.endpoints = list(endpoints)
        self.decisions: list[str] = []  # the endpoint of each request, "" for none
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def _headers_response(self, headers: dict[str, str]) -> ep.ProcessingResponse:
        pick = headers.get(PICK_HEADER, "")
        with self._lock:
            endpoint = (
                "" if pick == "none" else self.endpoints[int(pick) if pick else next(self._turn) % len(self.endpoints)]
            )
            self.decisions.append(endpoint)
        mutation = ep.HeaderMutation()
        if endpoint:
            value = base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=endpoint.encode())
            mutation.set_headers.append(base_pb2.HeaderValueOption(header=value, append_action=OVERWRITE))
        # No clear_route_cache: Envoy's route_cache_action CLEAR must re-route on its own.
        return ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mutation))
        )

    @staticmethod
    def _body_response(body: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
        streamed = ep.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
        mutation = ep.BodyMutation(streamed_response=streamed)
        return ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation)))

    def Process(
        self, request_iterator: Iterator[ep.ProcessingRequest], context: grpc.ServicerContext
    ) -> Iterator[ep.ProcessingResponse]:
        headers: dict[str, str] = {}
        body = bytearray()
        decided = False
        for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                headers = {
                    h.key.lower(): h.raw_value.decode() if h.raw_value else h.value
                    for h in message.request_headers.headers.headers
                }
                if message.request_headers.end_of_stream:
                    decided = True
                    yield self._headers_response(headers)
            elif kind == "request_body":
                body += message.request_body.body
                if message.request_body.end_of_stream:
                    decided = True
                    yield self._headers_response(headers)
                    for start in range(0, max(len(body), 1), 60_000):
                        yield self._body_response(bytes(body[start : start + 60_000]), start + 60_000 >= len(body))
            elif kind == "request_trailers":
                if not decided:
                    decided = True
                    yield self._headers_response(headers)
                    yield self._body_response(bytes(body), False)
                yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())


class FakeEppServer:
    """FakeEpp served on 127.0.0.1:port until stop(), with grpc.health.v1 saying SERVING as the EPP does."""

    def __init__(self, port: int, endpoints: Sequence[str]) -> None:
        self.epp = FakeEpp(endpoints)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        ep_grpc.add_ExternalProcessorServicer_to_server(self.epp, self.server)
        self.health = health.HealthServicer()
        self.health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=0).wait()
