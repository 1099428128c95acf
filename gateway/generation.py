"""One chat request through a rank: render and tokenize the prompt, refuse what cannot fit before any rank
work, stream tokens back as text, reasoning and tool-call events, and finish with usage.

Transport-free: the Anthropic and OpenAI layers turn these events into their own wire formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from gateway.chat import ChatRequest
from gateway.detokenizer import IncrementalDetokenizer
from gateway.parsing.events import OutputEvent, ToolCallStart
from gateway.rank_client import RankClient, RankFailed, RankRefused, RankStream
from gateway.served_model import ServedModel

if TYPE_CHECKING:
    from gateway.prompt_format import PromptFormat
from protos import rank_worker_pb2 as pb


class PromptTooLong(ValueError):
    """The prompt alone does not fit the model's context (HTTP 400, before any rank work)."""


class BadRequest(ValueError):
    """The rank refused the request as invalid (HTTP 400)."""


class Overloaded(Exception):
    """Every rank's queue is full (HTTP 529, retry later)."""

    retry_after_s = 5


class Unavailable(Exception):
    """No rank could take the request (HTTP 503 / api_error)."""


class StreamBroken(Exception):
    """The rank failed after tokens were sent: the client gets an error event, never a silent end."""


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class Ping:
    """Nothing new yet (a long prefill): keep proxies and clients from timing out."""


@dataclass
class Finish:
    reason: str  # "stop" | "length" | "tool_calls" | "stop_sequence"
    usage: Usage
    stop_sequence: str | None = None
    queue_wait_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    rank: str = ""


GenerationEvent = OutputEvent | Ping | Finish


@dataclass
class PreparedRequest:
    chat: ChatRequest
    prompt_text: str
    prompt_ids: list[int]
    max_tokens: int
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class Generation:
    """Shared by all API layers of one gateway process."""

    def __init__(
        self,
        ranks: RankClient,
        model: ServedModel,
        prompts: PromptFormat,
        ping_interval_s: float,
        request_timeout_s: float,
        default_temperature: float | None = None,
        default_top_p: float | None = None,
    ) -> None:
        self.default_temperature = 1.0 if default_temperature is None else default_temperature
        self.default_top_p = 1.0 if default_top_p is None else default_top_p
        self.ranks = ranks
        self.model = model
        self.prompts = prompts
        self.ping_interval_s = ping_interval_s
        self.request_timeout_s = request_timeout_s

    def prepare(self, chat: ChatRequest) -> PreparedRequest:
        """Everything that can be refused without a rank: model name, prompt size; max_tokens is clamped."""
        self.model.check_name(chat.model)
        text = self.prompts.render(chat)
        ids = self.model.encode(text)
        limit = self.model.max_model_len
        if len(ids) >= limit:
            raise PromptTooLong(
                f"prompt is too long: {len(ids)} tokens, and this model's context is {limit} tokens "
                f"(at most {limit - 1} prompt tokens leave room for an answer)"
            )
        room = limit - len(ids)
        wanted = chat.max_tokens if chat.max_tokens is not None else room
        return PreparedRequest(chat, text, ids, max(1, min(wanted, room)))

    def count_tokens(self, chat: ChatRequest) -> int:
        self.model.check_name(chat.model)
        return len(self.model.encode(self.prompts.render(chat)))

    async def open(self, prepared: PreparedRequest) -> OpenGeneration:
        """Find a rank that accepts the request. Refusals raise here, before any response is sent."""
        stream = await self._start(prepared, avoid=set())
        return OpenGeneration(self, prepared, stream)

    async def _start(self, prepared: PreparedRequest, avoid: set[str]) -> RankStream:
        chat = prepared.chat
        sampling = pb.SamplingParams(
            temperature=self.default_temperature if chat.temperature is None else chat.temperature,
            top_p=self.default_top_p if chat.top_p is None else chat.top_p,
            top_k=chat.top_k,
            max_tokens=prepared.max_tokens,
        )
        if chat.seed is not None:
            sampling.seed = chat.seed
        request = pb.GenerateRequest(
            request_id=prepared.request_id,
            prompt_token_ids=prepared.prompt_ids,
            sampling=sampling,
            session_id=chat.session_id,
        )
        candidates = self.ranks.preference(chat.session_id, avoid)
        if not candidates:
            raise Unavailable("no rank worker left to try")
        full = 0
        last_error: RankRefused | None = None
        for target in candidates:
            try:
                return await self.ranks.start(target, request, self.request_timeout_s)
            except RankRefused as exc:
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise BadRequest(exc.details) from exc
                full += exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                last_error = exc
        if full == len(candidates):
            raise Overloaded(f"all {full} rank(s) are at their queue limit")
        raise Unavailable(str(last_error))


class OpenGeneration:
    """A request a rank accepted: iterate `events()` once; closing it early cancels the rank request."""

    def __init__(self, owner: Generation, prepared: PreparedRequest, stream: RankStream) -> None:
        self.owner = owner
        self.prepared = prepared
        self.stream = stream
        self.started = time.monotonic()

    async def events(self) -> AsyncIterator[GenerationEvent]:
        owner, prepared = self.owner, self.prepared
        parser = owner.prompts.output_parser(prepared.prompt_text)
        stops = owner.prompts.stop_matcher(prepared.chat.stop)
        detok = IncrementalDetokenizer(owner.model.tokenizer)
        first_token_at: float | None = None
        saw_tool_call = False
        stop_sequence: str | None = None
        pending: list[str] = []  # text still to parse once the stream is over
        chunks = self._token_chunks()
        try:
            async for item in chunks:
                if isinstance(item, Ping):
                    yield item
                    continue
                if first_token_at is None:
                    first_token_at = time.monotonic()
                text, stop_sequence = stops.feed(detok.push(item))
                for event in parser.feed(text):
                    saw_tool_call |= isinstance(event, ToolCallStart)
                    yield event
                if stop_sequence is not None:
                    break
        finally:
            await chunks.aclose()  # on a stop string or a client gone: cancels the rank request
        if stop_sequence is None:
            text, stop_sequence = stops.feed(detok.finish())
            pending.append(text)
        if stop_sequence is None:
            pending.append(stops.finish())
        events = [event for text in pending for event in parser.feed(text)] + parser.finish()
        for event in events:
            saw_tool_call |= isinstance(event, ToolCallStart)
            yield event
        yield self._finish(saw_tool_call, stop_sequence, first_token_at, len(detok.token_ids))

    async def _token_chunks(self) -> AsyncIterator[list[int] | Ping]:
        """Token chunks from the rank, Ping when none came for a while. A rank that fails before its first
        token is replaced once (by another rank when there is one); after that, the failure is final."""
        retried = False
        while True:
            queue: asyncio.Queue[list[int] | BaseException | None] = asyncio.Queue()
            reader = asyncio.create_task(_pump(self.stream, queue))
            failure: RankFailed | None = None
            try:
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), self.owner.ping_interval_s)
                    except TimeoutError:
                        yield Ping()
                        continue
                    if item is None:
                        return
                    if isinstance(item, RankFailed):
                        failure = item
                        break
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
                if not self.stream.call.done():
                    self.stream.cancel()
            if failure.tokens_sent > 0 or retried:
                raise StreamBroken(str(failure)) from failure
            retried = True  # nothing reached the client yet: once more
            self.stream = await self.owner._start(self.prepared, avoid={self.stream.target})

    def _finish(
        self, saw_tool_call: bool, stop_sequence: str | None, first_token_at: float | None, output_tokens: int
    ) -> Finish:
        done = self.stream.finished
        stats = (
            done.stats
            if done is not None
            else pb.GenerateStats(cached_tokens=self.stream.cached_tokens, queue_wait_s=self.stream.queue_wait_s)
        )
        usage = Usage(
            prompt_tokens=self.prepared.prompt_tokens,
            cached_tokens=min(stats.cached_tokens, self.prepared.prompt_tokens),
            output_tokens=stats.output_tokens or output_tokens,
        )
        if stop_sequence is not None:
            reason = "stop_sequence"
        elif saw_tool_call:
            reason = "tool_calls"
        elif done is not None and done.finish_reason == pb.FINISH_REASON_LENGTH:
            reason = "length"
        else:
            reason = "stop"
        now = time.monotonic()
        ttft = (first_token_at or now) - self.started
        return Finish(
            reason, usage, stop_sequence, stats.queue_wait_s, ttft, now - (first_token_at or now), self.stream.target
        )

    async def aclose(self) -> None:
        if not self.stream.call.done():
            self.stream.cancel()


async def _pump(stream: RankStream, queue: asyncio.Queue[list[int] | BaseException | None]) -> None:
    try:
        async for chunk in stream.token_chunks():
            queue.put_nowait(chunk)
        queue.put_nowait(None)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # handed to the consumer, which decides: retry, or an error event
        queue.put_nowait(exc)
