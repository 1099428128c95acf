"""The RankWorker gRPC service: wire messages in and out of the engine loop, nothing more.

Requests are validated by the engine (EngineLoop.submit calls engine.validate) so every engine behind
this worker refuses bad input the same way: INVALID_ARGUMENT with the engine's message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from contracts.kv_event_feed import KvEventsEndedError
from contracts.kv_events import batch_message
from protos import kv_events_pb2 as events_pb
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc
from rank_worker.engine.interface import (
    EngineRequest,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    ModelInfo,
    RequestOutput,
    RequestStats,
    SamplingParams,
)
from rank_worker.engine_loop import EngineFailedError, EngineLoop, EngineLoopStoppedError, RequestStream
from rank_worker.metrics import RankMetrics

log = logging.getLogger(__name__)

# A stream with no token for this long gets a Progress message, so its client can tell a long prefill or a
# queue from a hung rank.
PROGRESS_INTERVAL_S = 1.0

_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def engine_request(message: pb.GenerateRequest) -> EngineRequest:
    """The engine's request for a wire request; 0 means "off" for top_p on the wire, 1.0 in the engine."""
    wire = message.sampling
    sampling = SamplingParams(
        temperature=wire.temperature,
        top_p=1.0 if wire.top_p == 0.0 else wire.top_p,
        top_k=wire.top_k,
        seed=wire.seed if wire.HasField("seed") else None,
        stop_token_ids=tuple(wire.stop_token_ids),
        max_tokens=wire.max_tokens,
        ignore_eos=wire.ignore_eos,
    )
    request_id = message.request_id or f"rw-{uuid.uuid4().hex}"
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=list(message.prompt_token_ids),
        sampling=sampling,
        prompt_block_hashes=list(message.prompt_block_hashes),
        block_hash_namespace=message.block_hash_namespace,
    )


def finished_message(output: RequestOutput) -> pb.GenerateResponse:
    stats = output.stats or RequestStats()
    return pb.GenerateResponse(
        finished=pb.Finished(
            finish_reason=_FINISH_REASONS.get(output.finish_reason, pb.FINISH_REASON_UNSPECIFIED),  # type: ignore[arg-type]
            stop_token_id=-1 if output.stop_token_id is None else output.stop_token_id,
            stats=pb.GenerateStats(**dataclasses.asdict(stats)),  # same field names by design
        )
    )


def finished_line(request_id: str, finished: pb.Finished) -> str:
    """The log line of a request that finished: how it ended, its cache use and its times."""
    stats = finished.stats
    reason = pb.FinishReason.Name(finished.finish_reason).removeprefix("FINISH_REASON_").lower()
    return (
        f"finished request={request_id} reason={reason} prompt_tokens={stats.prompt_tokens} "
        f"l0_cached_tokens={stats.l0_cached_tokens} l1_cached_tokens={stats.l1_cached_tokens} "
        f"output_tokens={stats.output_tokens} queue_ms={stats.queue_wait_s * 1000:.1f} "
        f"prefill_ms={stats.prefill_s * 1000:.1f} total_ms={stats.total_s * 1000:.1f} preemptions={stats.preemptions}"
    )


def request_stats(stats: pb.GenerateStats) -> RequestStats:
    return RequestStats(**{field.name: getattr(stats, field.name) for field in dataclasses.fields(RequestStats)})


def stats_message(stats: EngineStats, rank_id: str = "") -> pb.StatsResponse:
    return pb.StatsResponse(rank_id=rank_id, **dataclasses.asdict(stats))  # same field names by design


def model_info_message(info: ModelInfo) -> pb.ModelInfoResponse:
    message = pb.ModelInfoResponse(
        served_model_name=info.served_model_name,
        model_id=info.model_id,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        trained_context_len=info.trained_context_len,
        block_size=info.block_size,
        hash_namespace=info.hash_namespace,
        bos_token_id=-1,
        model_type=info.model_type,
    )
    tokenizer = info.tokenizer
    if tokenizer is not None:
        message.tokenizer_json = tokenizer.tokenizer_json
        message.chat_template = tokenizer.chat_template
        message.bos_token_id = -1 if tokenizer.bos_token_id is None else tokenizer.bos_token_id
        message.eos_token_ids.extend(tokenizer.eos_token_ids)
        message.bos_token = tokenizer.bos_token
        message.eos_token = tokenizer.eos_token
        message.add_bos_token = tokenizer.add_bos_token
    return message


class RankWorkerServicer(pb_grpc.RankWorkerServicer):
    """Serves one engine loop. Until attach() is called (the model is loading) every RPC is UNAVAILABLE."""

    def __init__(self, max_waiting_requests: int = 256, progress_interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self._max_waiting = max_waiting_requests
        self._progress_interval_s = progress_interval_s
        self._rank_id = ""
        self._engine_loop: EngineLoop | None = None
        self._model_info: pb.ModelInfoResponse | None = None
        self._metrics: RankMetrics | None = None

    def attach(
        self, engine_loop: EngineLoop, model_info: ModelInfo, rank_id: str = "", metrics: RankMetrics | None = None
    ) -> None:
        self._model_info = model_info_message(model_info)
        self._rank_id = rank_id
        self._metrics = metrics
        self._engine_loop = engine_loop

    async def _ready(self, context: grpc.aio.ServicerContext) -> EngineLoop:
        if self._engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the rank worker is still loading its model")
        assert self._engine_loop is not None
        return self._engine_loop

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        engine_loop = await self._ready(context)
        engine_req = engine_request(request)
        # Every line about the request names it as request=<id>: the gateway's id, which its client got.
        request_id = engine_req.request_id
        if engine_loop.queued() >= self._max_waiting:
            log.info("refused request=%s: the queue is full", request_id)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"rank queue is full ({self._max_waiting} requests waiting)"
            )
        try:
            stream = engine_loop.submit(engine_req)
        except InvalidRequestError as exc:
            log.info("refused request=%s: %s", request_id, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineLoopStoppedError as exc:
            log.info("refused request=%s: %s", request_id, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info(
            "accepted request=%s prompt_tokens=%d max_tokens=%d",
            request_id,
            len(engine_req.prompt_token_ids),
            engine_req.sampling.max_tokens,
        )
        # Accepted: clients wait for these headers to learn, before any token, that the request is queued
        # (a refusal above arrives instead as an error status).
        await context.send_initial_metadata((("kvserve-accepted", request_id),))
        timer = self._metrics.request() if self._metrics is not None else None
        try:
            async for message in response_messages(stream, engine_loop, self._progress_interval_s):
                if message.HasField("finished"):
                    log.info("%s", finished_line(request_id, message.finished))
                if timer is not None:  # as the message is handed to gRPC
                    if message.HasField("tokens"):
                        timer.tokens(len(message.tokens.token_ids))
                    elif message.HasField("finished"):
                        reason = pb.FinishReason.Name(message.finished.finish_reason).removeprefix("FINISH_REASON_")
                        timer.finished(request_stats(message.finished.stats), reason.lower())
                yield message
        except InvalidRequestError as exc:  # refused at add_request time (validate() could not know)
            log.info("refused request=%s: %s", request_id, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineLoopStoppedError as exc:
            log.info("ended request=%s: %s", request_id, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except EngineFailedError as exc:
            log.warning("failed request=%s: %s", request_id, exc)
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        finally:
            if not stream.finished:  # the client went away (cancelled) or the server is stopping
                engine_loop.abort(request_id)
                log.info("cancelled request=%s: its call ended before the request did", request_id)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        engine_loop = await self._ready(context)
        return stats_message(engine_loop.stats(), self._rank_id)

    async def KvEvents(
        self, request: events_pb.KvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[events_pb.KvEventBatch]:
        engine_loop = await self._ready(context)
        subscription = engine_loop.subscribe_kv_events()
        try:
            while True:
                try:
                    batch = await subscription.get()
                except KvEventsEndedError:
                    return
                yield batch_message(batch)
        finally:
            subscription.close()

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        await self._ready(context)
        assert self._model_info is not None
        return self._model_info


async def response_messages(
    stream: RequestStream, engine_loop: EngineLoop, progress_interval_s: float
) -> AsyncIterator[pb.GenerateResponse]:
    """TokenChunks as tokens come (outputs that queued up while we were sending go out as one chunk),
    Progress while none comes for a while and the engine loop is making progress, then one Finished."""
    sent_first = False
    while not stream.finished:
        try:
            first = await asyncio.wait_for(anext(stream), progress_interval_s)
        except TimeoutError:
            progress = engine_loop.progress(stream.request_id)
            if progress is not None:  # a stuck engine thread sends nothing: the client may fail over
                yield pb.GenerateResponse(
                    progress=pb.Progress(computed_prompt_tokens=progress.computed_prompt_tokens, queued=progress.queued)
                )
            continue
        except StopAsyncIteration:
            return
        outputs = [first, *stream.ready()]
        token_ids = [token for output in outputs for token in output.new_token_ids]
        if token_ids:
            chunk = pb.TokenChunk(token_ids=token_ids)
            if not sent_first and outputs[0].stats is not None:
                chunk.l0_cached_tokens = outputs[0].stats.l0_cached_tokens
                chunk.l1_cached_tokens = outputs[0].stats.l1_cached_tokens
                chunk.queue_wait_s = outputs[0].stats.queue_wait_s
            sent_first = True
            yield pb.GenerateResponse(tokens=chunk)
        if outputs[-1].finished:
            yield finished_message(outputs[-1])
