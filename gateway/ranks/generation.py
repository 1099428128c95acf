"""One chat request through a rank: render and tokenize the prompt, refuse what cannot fit before any rank
work, stream tokens back as text, reasoning and tool-call events, and finish with usage.

Transport-free: the Anthropic and OpenAI layers turn these events into their own wire formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from gateway.http.errors import BadRequest, InvalidRequest, Overloaded, StreamBroken, Unavailable
from gateway.parsing.events import OutputEvent, ToolCallStart
from gateway.prompt.chat import ChatRequest
from gateway.prompt.detokenizer import IncrementalDetokenizer
from gateway.prompt.prompt_format import PromptFormat, prompt_of
from gateway.prompt.served_model import ServedModel
from gateway.ranks.prompt_hashes import prompt_block_hashes, route_block_hashes
from gateway.ranks.rank_choice import RankChoice, RankChooser
from gateway.ranks.rank_client import RankClient, RankFailed, RankRefused, RankStream, RequestFailed, rank_at_fault
from gateway.ranks.rank_recovery import FailedRanks, RankRevivals, until_a_rank_takes_it
from gateway.ranks.session_key import routing_session_id
from protos import rank_worker_pb2 as pb
from protos import router_pb2 as router_pb

log = logging.getLogger(__name__)


# A stream cut by a failing rank is continued (on another rank, or on the same one once it is back) this many times
# at most: a rank or expert-parallel group restart cuts a stream once, a rank that keeps failing ends it.
MAX_RANK_SWITCHES = 2
# A rank silent for rank_stall_s is given this much longer before it is taken for hung: after a pause of our
# own event loop, messages the rank sent meanwhile are still on their way to the reader.
STALL_GRACE_S = 0.5


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # from any tier: L0 (GPU) + L1 (host)
    output_tokens: int = 0
    l1_cached_tokens: int = 0

    @property
    def l0_cached_tokens(self) -> int:
        return self.cached_tokens - self.l1_cached_tokens

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
    rank_switches: int = 0  # continuations after a rank failed the stream


GenerationEvent = OutputEvent | Ping | Finish


@dataclass
class PreparedRequest:
    chat: ChatRequest
    prompt_text: str
    prompt_ids: list[int]
    max_tokens: int
    request_id: str  # the id the client got (msg_..., chatcmpl-...): the router and the rank log it too
    block_hashes: list[bytes] = field(default_factory=list)  # of the prompt's full blocks (prompt_hashes)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class Generation:
    """Shared by all API layers of one gateway process."""

    def __init__(
        self,
        ranks: RankClient,
        chooser: RankChooser,
        model: ServedModel,
        prompts: PromptFormat,
        ping_interval_s: float,
        request_timeout_s: float,
        default_temperature: float | None = None,
        default_top_p: float | None = None,
        rank_stall_s: float = 5.0,
        rank_recovery_wait_s: float = 120.0,
    ) -> None:
        self.default_temperature = 1.0 if default_temperature is None else default_temperature
        self.default_top_p = 1.0 if default_top_p is None else default_top_p
        self.ranks = ranks
        self.chooser = chooser
        self.model = model
        self.prompts = prompts
        self.ping_interval_s = ping_interval_s
        self.request_timeout_s = request_timeout_s
        self.rank_stall_s = rank_stall_s  # no token nor progress (nor acceptance) for this long: the rank is hung
        self.rank_recovery_wait_s = rank_recovery_wait_s  # with no rank to take a request, wait this long for one
        self.revivals = RankRevivals(ranks.serving)
        self.waiting_for_rank = 0  # requests waiting now for a rank to come back

    def prepare(self, chat: ChatRequest, request_id: str) -> PreparedRequest:
        """Everything that can be refused without a rank: model name, prompt size; max_tokens is clamped. The
        prompt's block hashes too: like tokenizing, this runs off the event loop (flow)."""
        text, ids = self.prompt(chat)
        room = self.model.max_model_len - len(ids)
        wanted = chat.max_tokens if chat.max_tokens is not None else room
        hashes = prompt_block_hashes(self.model.info, ids)
        return PreparedRequest(chat, text, ids, max(1, min(wanted, room)), request_id, block_hashes=hashes)

    def count_tokens(self, chat: ChatRequest) -> int:
        """The prompt's exact size; what a request could not send (PromptTooLong) is refused here the same way."""
        return len(self.prompt(chat)[1])

    def prompt(self, chat: ChatRequest) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids, once the model name and the prompt's size are checked."""
        return prompt_of(self.model, self.prompts, chat)

    async def open(self, prepared: PreparedRequest, arrived: float | None = None) -> OpenGeneration:
        """Find a rank that accepts the request. Refusals raise here, before any response is sent, except that no
        rank is up (a rank or group restarting): the generation then waits for one in `events()` (pings keep a
        stream alive meanwhile) and fails as Unavailable after rank_recovery_wait_s. arrived: when the request
        came in (time.monotonic()), where its time to first token starts; default now."""
        try:
            stream, choice = await self._start(prepared, avoid=set())
        except Unavailable as exc:
            return OpenGeneration(self, prepared, None, None, arrived, no_rank=exc)
        return OpenGeneration(self, prepared, stream, choice, arrived)

    async def start_when_a_rank_is_back(
        self,
        prepared: PreparedRequest,
        failed: FailedRanks,
        continuation: list[int] | None,
        refusal: Unavailable | Overloaded,
    ) -> tuple[RankStream, RankChoice]:
        """_start once a rank takes the request: one of the `failed` ranks back (restarted, or resumed), or
        another one. `refusal` (why none could just now), or the last one, is raised after rank_recovery_wait_s."""

        async def attempt(avoid: set[str]) -> tuple[RankStream, RankChoice]:
            try:
                return await self._start(prepared, avoid, continuation)
            except Unavailable as exc:
                failed.update(exc.refused)
                raise

        request_id = prepared.request_id
        wait_s = self.rank_recovery_wait_s
        log.warning(
            "request=%s: no rank can take it now (%s); waiting up to %.0f s for one to come back",
            request_id,
            refusal,
            wait_s,
        )
        began = time.monotonic()
        self.waiting_for_rank += 1
        try:
            opened = await until_a_rank_takes_it(
                attempt, failed, self.revivals, wait_s, refusal, (Unavailable, Overloaded)
            )
        except (Unavailable, Overloaded) as exc:
            log.warning("request=%s: no rank took it within %.0f s: %s", request_id, time.monotonic() - began, exc)
            raise
        finally:
            self.waiting_for_rank -= 1
        log.info("request=%s: rank %s took it after %.1f s", request_id, opened[1].rank_id, time.monotonic() - began)
        return opened

    def _sampling(self, chat: ChatRequest, max_tokens: int) -> pb.SamplingParams:
        try:
            sampling = pb.SamplingParams(
                temperature=self.default_temperature if chat.temperature is None else chat.temperature,
                top_p=self.default_top_p if chat.top_p is None else chat.top_p,
                top_k=chat.top_k,
                max_tokens=max_tokens,
                ignore_eos=chat.ignore_eos,
            )
            if chat.seed is not None:
                sampling.seed = chat.seed
        except ValueError as exc:  # the client's seed or top_k is out of its field's range ("Value out of range")
            raise InvalidRequest(str(exc)) from exc
        return sampling

    async def _start(
        self, prepared: PreparedRequest, avoid: set[str], continuation: list[int] | None = None
    ) -> tuple[RankStream, RankChoice]:
        """Open a stream on the best rank that accepts; `continuation` (tokens already sent to the client)
        extends the prompt, so a stream cut on one rank goes on from where it stopped on another."""
        chat = prepared.chat
        extra = continuation or []
        prompt_ids = prepared.prompt_ids + extra
        sampling = self._sampling(chat, prepared.max_tokens - len(extra))
        request_id = f"{prepared.request_id}+{len(extra)}" if extra else prepared.request_id
        session_id = routing_session_id(chat.session_id)
        info = self.model.info
        hashes = prepared.block_hashes
        if extra:  # the continued prompt's chain goes on from the prompt's (a long output: off the loop too)
            hashes = await asyncio.to_thread(prompt_block_hashes, info, prompt_ids, hashes)
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            session_id=session_id,
            prompt_block_hashes=hashes,
            block_hash_namespace=info.hash_namespace if hashes else b"",
        )
        query = router_pb.RouteRequest(
            request_id=request_id,
            session_id=session_id,
            block_hashes=route_block_hashes(info, len(prompt_ids), hashes),
            prompt_tokens=len(prompt_ids),
        )
        avoid = set(avoid)
        tried = full = 0
        last_error: RankRefused | None = None
        refused: dict[str, str] = {}
        while (choice := await self.chooser.choose(query, avoid)) is not None:
            tried += 1
            try:
                stream = await self.ranks.start(choice.address, request, self.request_timeout_s, self.rank_stall_s)
                return stream, choice
            except RankRefused as exc:
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise BadRequest(exc.details) from exc
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full += 1
                elif rank_at_fault(exc.code):
                    self.chooser.report_failure(choice, str(exc), request_id)
                else:  # the rank answered about this request: its own failure, not the rank's
                    raise StreamBroken(str(exc)) from exc
                last_error = exc
                avoid.add(choice.rank_id)
                refused[choice.rank_id] = choice.address
        if tried and full == tried:
            raise Overloaded(f"all {full} rank(s) are at their queue limit")
        raise Unavailable(str(last_error) if last_error else "no rank worker left to try", refused)


class OpenGeneration:
    """A request a rank accepted: iterate `events()` once; closing it early cancels the rank request."""

    def __init__(
        self,
        owner: Generation,
        prepared: PreparedRequest,
        stream: RankStream | None,
        choice: RankChoice | None,
        arrived: float | None = None,
        no_rank: Unavailable | None = None,
    ) -> None:
        self.owner = owner
        self.prepared = prepared
        self.stream = stream  # None until a rank takes the request (no_rank: none could when it came)
        self.choice = choice
        self.no_rank = no_rank
        self.started = time.monotonic() if arrived is None else arrived
        self.delivered: list[int] = []  # tokens handed on, across every rank that served this request
        self.delivered_before_stream = 0  # of those, the ones earlier streams produced
        self.cache_stream: RankStream | None = None  # the stream whose cache use the client's prompt got
        self.rank_switches = 0

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
        elif owner.prompts.ends_turn(stop_sequence, prepared.chat.stop):
            stop_sequence = None  # the model's own end of turn, written out as text
        events = [event for text in pending for event in parser.feed(text)] + parser.finish()
        for event in events:
            saw_tool_call |= isinstance(event, ToolCallStart)
            yield event
        yield self._finish(saw_tool_call, stop_sequence, first_token_at, len(detok.token_ids))

    async def _token_chunks(self) -> AsyncIterator[list[int] | Ping]:
        """Token chunks from the rank, Ping when none came for a while. When the rank fails (or says nothing,
        not even progress, for rank_stall_s: hung), the request goes on on another rank: from the prompt if
        nothing was sent yet, else from the prompt plus the tokens already sent (greedy output is then the
        same as an uninterrupted run). With no rank to take it now, it waits for one to come back (a restarted
        rank or group), pinging meanwhile. After MAX_RANK_SWITCHES, the failure is final. A failure of the
        request's own (RequestFailed) ends it here."""
        failed = FailedRanks()  # ranks that failed this request and are not back since
        ping_s, stall_s = self.owner.ping_interval_s, self.owner.rank_stall_s
        if self.no_rank is not None:  # no rank could take it when it came: wait for one
            failed.update(self.no_rank.refused)
            async for ping in self._wait_for_rank(failed, None, self.no_rank):
                yield ping
        while True:
            stream = self._open_stream()
            queue: asyncio.Queue[list[int] | BaseException | None] = asyncio.Queue()
            reader = asyncio.create_task(_pump(stream, queue))
            failure: RankFailed | None = None
            last_sent = time.monotonic()  # a token or a ping went to the client
            try:
                while True:
                    wait_s = min(ping_s - (time.monotonic() - last_sent), stall_s - stream.silent_for())
                    try:
                        item = await asyncio.wait_for(queue.get(), max(wait_s, 0.01))
                    except TimeoutError:
                        if stream.silent_for() >= stall_s and await _still_silent(stream, queue):
                            failure = self._stalled(stream)
                            break
                        if time.monotonic() - last_sent >= ping_s:
                            last_sent = time.monotonic()
                            yield Ping()
                        continue
                    if item is None:
                        return
                    if isinstance(item, RankFailed):
                        failure = item
                        break
                    if isinstance(item, RequestFailed):
                        if item.code == grpc.StatusCode.INVALID_ARGUMENT:
                            raise BadRequest(item.details) from item
                        raise StreamBroken(str(item)) from item
                    if isinstance(item, BaseException):
                        raise item
                    if self.cache_stream is None:
                        self.cache_stream = stream
                    self.delivered.extend(item)
                    last_sent = time.monotonic()
                    yield item
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
                if not stream.call.done():
                    stream.cancel()
            choice = self._chosen()
            self.owner.chooser.report_failure(choice, str(failure), stream.request_id)
            if self.rank_switches >= MAX_RANK_SWITCHES:
                raise StreamBroken(str(failure)) from failure
            if len(self.delivered) >= self.prepared.max_tokens:
                stream.finished = pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH, stop_token_id=-1)
                return  # it failed after its last token: nothing is missing
            failed.add(choice.rank_id, choice.address)
            continuation = list(self.delivered)
            try:
                try:
                    self.stream, self.choice = await self.owner._start(self.prepared, failed.avoid(), continuation)
                except (Unavailable, Overloaded) as exc:  # none can now: wait for one to come back
                    if isinstance(exc, Unavailable):
                        failed.update(exc.refused)
                    async for ping in self._wait_for_rank(failed, continuation, exc):
                        yield ping
            except (Unavailable, Overloaded, BadRequest) as exc:
                raise StreamBroken(f"{failure}; no other rank could continue: {exc}") from failure
            self.rank_switches += 1  # once per continuation, however long it waited for a rank
            self.delivered_before_stream = len(self.delivered)

    async def _wait_for_rank(
        self, failed: FailedRanks, continuation: list[int] | None, refusal: Unavailable | Overloaded
    ) -> AsyncIterator[Ping]:
        """Ping every ping_interval_s until a rank takes the request (its stream is then self.stream) or
        rank_recovery_wait_s has passed (the last refusal is raised)."""
        owner = self.owner
        waiting = asyncio.create_task(owner.start_when_a_rank_is_back(self.prepared, failed, continuation, refusal))
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=owner.ping_interval_s)
                if done:
                    self.stream, self.choice = waiting.result()
                    return
                yield Ping()
        finally:
            if not waiting.done():  # the client went away (or a cancel) while it waited
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await waiting
            elif not waiting.cancelled() and waiting.exception() is None and self.stream is not waiting.result()[0]:
                waiting.result()[0].cancel()  # a rank took it just as the waiter left

    def _open_stream(self) -> RankStream:
        assert self.stream is not None, "a rank has taken the request"
        return self.stream

    def _chosen(self) -> RankChoice:
        assert self.choice is not None, "a rank has taken the request"
        return self.choice

    def prompt_usage(self) -> Usage:
        """The prompt's usage as the rank reported it so far: its cache use comes with the first token (of the
        stream that served it), so until a token came nothing counts as cached; output: the tokens handed on."""
        cache = self.cache_stream or self.stream
        if cache is None:  # still waiting for a rank
            return _usage(self.prepared.prompt_tokens, 0, 0, len(self.delivered))
        return _usage(self.prepared.prompt_tokens, cache.l0_cached_tokens, cache.l1_cached_tokens, len(self.delivered))

    def _stalled(self, stream: RankStream) -> RankFailed:
        where = "queued" if stream.progress is None or stream.progress.queued else "in prefill or decode"
        detail = f"no token or progress for {stream.silent_for():.1f} s ({where}): the rank looks hung"
        return RankFailed(stream.target, grpc.StatusCode.DEADLINE_EXCEEDED, detail, stream.tokens_sent)

    def _finish(
        self, saw_tool_call: bool, stop_sequence: str | None, first_token_at: float | None, output_tokens: int
    ) -> Finish:
        stream = self._open_stream()
        done = stream.finished
        cache = self.cache_stream or stream
        stats = done.stats if done is not None else pb.GenerateStats()
        if cache is not stream or done is None:  # cache use of the stream that served the first token
            stats = pb.GenerateStats(
                l0_cached_tokens=cache.l0_cached_tokens,
                l1_cached_tokens=cache.l1_cached_tokens,
                queue_wait_s=cache.queue_wait_s,
                output_tokens=stats.output_tokens,
            )
        usage = _usage(
            self.prepared.prompt_tokens,
            stats.l0_cached_tokens,
            stats.l1_cached_tokens,
            self.delivered_before_stream + (stats.output_tokens or output_tokens - self.delivered_before_stream),
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
            reason,
            usage,
            stop_sequence,
            stats.queue_wait_s,
            ttft,
            now - (first_token_at or now),
            self._chosen().rank_id,
            self.rank_switches,
        )

    async def aclose(self) -> None:
        if self.stream is not None and not self.stream.call.done():
            self.stream.cancel()


def _usage(prompt_tokens: int, l0_cached: int, l1_cached: int, output_tokens: int) -> Usage:
    """Usage from the rank's cache counts: L0 hits, then L1 restores after them, never more than the prompt."""
    l0 = min(l0_cached, prompt_tokens)
    l1 = min(l1_cached, prompt_tokens - l0)
    return Usage(prompt_tokens, cached_tokens=l0 + l1, output_tokens=output_tokens, l1_cached_tokens=l1)


async def _still_silent(stream: RankStream, queue: asyncio.Queue[list[int] | BaseException | None]) -> bool:
    """Whether the rank stays silent for STALL_GRACE_S more (a pause of our own loop is not the rank's)."""
    heard = stream.last_heard
    await asyncio.sleep(STALL_GRACE_S)
    return stream.last_heard == heard and queue.empty()


async def _pump(stream: RankStream, queue: asyncio.Queue[list[int] | BaseException | None]) -> None:
    try:
        async for chunk in stream.token_chunks():
            queue.put_nowait(chunk)
        queue.put_nowait(None)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # handed to the consumer, which decides: retry, or an error event
        queue.put_nowait(exc)
