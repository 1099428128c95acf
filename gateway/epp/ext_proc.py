"""Envoy's ExternalProcessor (envoy.service.ext_proc.v3) for the EPP: the transport around picker.py.

Envoy streams each request to us: its headers, then its body in FULL_DUPLEX_STREAMED mode (pieces as they come;
we hold them, and send the body back once decided, since in that mode Envoy keeps no copy). At the body's end
the EPP decides and answers the headers with `x-gateway-destination-endpoint: ip:port` (and the same under the
`envoy.lb` dynamic metadata, as the Gateway API Inference Extension's EPPs do), clearing the route cache so the
route that reads the header applies, then streams the body back unchanged. A request without a body is decided
at its headers. A refusal (bad body, unknown model, no ready node, shedding) is an ImmediateResponse in the API's
own error shape; nothing waits on anything but Envoy's stream and the decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from gateway.epp.fleet_config import DESTINATION_HEADER, DESTINATION_METADATA_NAMESPACE
from gateway.epp.picker import Decision, Picker, ReadRequest, Refusal, error_api, read_request, refusal_for
from gateway.http.errors import ApiError, render_error

log = logging.getLogger(__name__)

BODY_PIECE_BYTES = 62_500  # what one streamed body answer carries (Envoy's ext_proc messages stay small)
OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.Value("OVERWRITE_IF_EXISTS_OR_ADD")


def _headers(header_map: base_pb2.HeaderMap) -> dict[str, str]:
    return {
        header.key.lower(): header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        for header in header_map.headers
    }


def _set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=OVERWRITE
    )


def destination_response(endpoint: str) -> ep.ProcessingResponse:
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_METADATA_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    common = ep.CommonResponse(
        header_mutation=ep.HeaderMutation(set_headers=[_set_header(DESTINATION_HEADER, endpoint)]),
        clear_route_cache=True,
    )
    return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata)


def body_responses(body: bytes, end_of_stream: bool = True) -> list[ep.ProcessingResponse]:
    pieces = [body[i : i + BODY_PIECE_BYTES] for i in range(0, len(body), BODY_PIECE_BYTES)] or [b""]
    return [
        ep.ProcessingResponse(
            request_body=ep.BodyResponse(
                response=ep.CommonResponse(
                    body_mutation=ep.BodyMutation(
                        streamed_response=ep.StreamedBodyResponse(
                            body=piece, end_of_stream=end_of_stream and n == len(pieces) - 1
                        )
                    )
                )
            )
        )
        for n, piece in enumerate(pieces)
    ]


def immediate_response(path: str, error: ApiError) -> ep.ProcessingResponse:
    headers = [_set_header("content-type", "application/json")]
    if error.retry_after_s:
        headers.append(_set_header("retry-after", str(error.retry_after_s)))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=ep.HeaderMutation(set_headers=headers),
            body=render_error(error_api(path).error_document(error)),
            details=f"kvserve_epp_{error.kind}",
        )
    )


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    def __init__(
        self, picker: Picker, max_body_bytes: int, on_decision: Callable[[Decision | None, str, float], None]
    ) -> None:
        self._picker = picker
        self._max_body_bytes = max_body_bytes
        self._on_decision = on_decision  # (decision or None for a refusal, reason or status, seconds)

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        headers: dict[str, str] = {}
        body = bytearray()
        decided = False
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                headers = _headers(message.request_headers.headers)
                if message.request_headers.end_of_stream:
                    decided = True
                    for response in await self._decide(headers, None):
                        yield response
            elif kind == "request_body":
                if decided:
                    continue
                body += message.request_body.body
                if len(body) > self._max_body_bytes:
                    decided = True
                    error = ApiError(413, "request_too_large", "request body is too large")
                    self._on_decision(None, "413", 0.0)
                    yield immediate_response(headers.get(":path", ""), error)
                    return
                if message.request_body.end_of_stream:
                    decided = True
                    for response in await self._decide(headers, bytes(body)):
                        yield response
            elif kind == "request_trailers":
                if not decided:  # the body ended with trailers, not with an end_of_stream piece
                    decided = True
                    for response in await self._decide(headers, bytes(body), body_ends=False):
                        yield response
                yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
            elif kind == "response_headers":
                yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
            elif kind == "response_body":
                yield ep.ProcessingResponse(response_body=ep.BodyResponse())
            elif kind == "response_trailers":
                yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

    async def _decide(self, headers: dict[str, str], body: bytes | None, body_ends: bool = True) -> list[Any]:
        """The answers to a request once its body is in (None: it has none): the headers' with the destination
        and the body streamed back, or one ImmediateResponse."""
        started = time.monotonic()
        path = headers.get(":path", "")
        try:
            prompters = self._picker.prompters()
            request: ReadRequest = await asyncio.to_thread(read_request, path, headers, body or b"", prompters)
            decision = self._picker.choose(request, path)
        except Refusal as refusal:
            self._on_decision(None, str(refusal.error.status), time.monotonic() - started)
            return [immediate_response(path, refusal.error)]
        except Exception as exc:  # a bug of ours is this request's 500, never a broken stream for Envoy to judge
            log.exception("epp failed to decide for %s", path)
            error = refusal_for(exc).error
            self._on_decision(None, str(error.status), time.monotonic() - started)
            return [immediate_response(path, error)]
        self._on_decision(decision, decision.choice.reason, time.monotonic() - started)
        responses = [destination_response(decision.node.destination)]
        if body is not None:
            responses += body_responses(body, body_ends)
        return responses
