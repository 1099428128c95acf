"""Our engine rank: paged KV pool + L0 prefix cache (+ the L1 host tier when given a kvstore client) +
continuous batching around the model (the Llama family or DeepSeek: model/causal_lm.py)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from contracts.block_hash import hash_namespace, tokenizer_fingerprint
from contracts.config import EngineConfig, SchedulingConfig
from contracts.kv_events import KvEvent
from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.gpu_timer import span_s
from rank_worker.engine.interface import (
    Engine,
    EngineRequest,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    ModelInfo,
    RequestOutput,
    RequestsFailedError,
    RequestStats,
    TokenizerBundle,
)
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.model_runner import LaunchedStep, ModelRunner, kv_pool_shape
from rank_worker.engine.scheduler import ScheduledBatch, Scheduler
from rank_worker.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from rank_worker.engine.step_cost import StepLoad
from rank_worker.engine.step_inputs import CarriedTokens
from rank_worker.engine.step_token_cap import StepTokenCap
from rank_worker.engine.step_trace import phase
from rank_worker.expert_parallel.lockstep import Lockstep
from rank_worker.l1.eviction_horizon import horizon_blocks_for
from rank_worker.l1.kvstore_client import KvStoreClient
from rank_worker.l1.slot_reserve import reserved_slots_for
from rank_worker.l1.tier import DEFAULT_RETRY_INTERVAL_S, L1Tier
from rank_worker.model.attention import kv_quant
from rank_worker.model.attention.backend import AttentionBackend
from rank_worker.model.causal_lm import CausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """What a rank derives at start-up (its pool's size, its model's window and names), with the config's engine and
    scheduling sections as they are."""

    num_blocks: int
    max_model_len: int = 2048
    trained_context_len: int = 2048
    served_model_name: str = "model"
    model_id: str = "model"
    weights_digest: str = ""  # part of the block-hash namespace: another checkpoint never shares its KV
    engine: EngineConfig = field(default_factory=EngineConfig)
    # The factory resolves decode_step_budget_ms for the device first (unset here: a GPU's); solo_prefill_tokens
    # unset: what the attention backend prefers (solo_prefill_tokens below).
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)


def solo_prefill_tokens(settings: EngineSettings, backend: AttentionBackend) -> int:
    """The scheduler's solo_prefill_tokens: the setting, or where unset the backend's preference; within
    max_model_len, and 0 where it would not pass max_num_batched_tokens (a step takes that much anyway)."""
    setting = settings.scheduling.solo_prefill_tokens
    wanted = backend.solo_prefill_tokens if setting is None else setting
    solo = min(wanted, settings.max_model_len)
    return solo if solo > settings.engine.max_num_batched_tokens else 0


def eviction_horizon_blocks(settings: EngineSettings, solo_tokens: int) -> int:
    """L1Tier's horizon: the setting, or what the longest step (a solo prefill, else a full chunk) asks for."""
    step_tokens = max(settings.engine.max_num_batched_tokens, solo_tokens)
    return horizon_blocks_for(settings.engine.l1_eviction_horizon_blocks, step_tokens, settings.engine.block_size)


@dataclass(eq=False)
class _InFlight:
    """A step launched on the device whose tokens the host has not read yet."""

    batch: ScheduledBatch
    launched: LaunchedStep
    load: StepLoad  # what it carries, taken at launch (the step-cost model's row)
    started: float  # perf_counter at launch
    advanced: bool = False  # its sequences' computed tokens counted (at its successor's launch, or when read)
    # Sequences that finished or were aborted while it ran: their blocks and table rows go back once it is read.
    release_after: list[Sequence] = field(default_factory=list)
    # Where its draws already stand in token_ids as PENDING_TOKEN (its successor took them on the device): the
    # index in each sequence's token_ids that its token replaces when read.
    pending_at: dict[Sequence, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.members = dict(self.batch.entries)  # each sequence's tokens in it


class PagedEngine(Engine):
    def __init__(
        self,
        model: CausalLM,
        settings: EngineSettings,
        tokenizer: TokenizerBundle | None = None,
        l1_client: KvStoreClient | None = None,
        l1_retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        lockstep: Lockstep | None = None,
    ) -> None:
        """lockstep: the rank's expert-parallel group (None: a rank on its own). In a group every step() call
        launches exactly one forward agreed with the group's ranks (an empty one when it has nothing to run)."""
        self.model = model
        self.lockstep = lockstep
        self.settings = settings
        self.tokenizer = tokenizer
        device = model.embed_tokens.device
        dtype = model.embed_tokens.dtype
        kv_dtype = kv_quant.pool_dtype(settings.engine.kv_cache_dtype, dtype)
        # Refused by name before the pool is allocated or CUDA asked: the kernels do not read fp8.
        attention_setting = kv_quant.check_backend(settings.engine.attention_backend, kv_dtype)
        # zeros, not empty: padded decode slots are masked, but NaN garbage would still poison 0 * NaN.
        # One block past the pool is scratch: no sequence owns it; padded rows of graph steps write there.
        self.kv_cache = torch.zeros(
            kv_pool_shape(model, settings.num_blocks + 1, settings.engine.block_size), dtype=kv_dtype, device=device
        )
        fingerprint = tokenizer_fingerprint(tokenizer.tokenizer_json) if tokenizer else "no-tokenizer"
        self.namespace = hash_namespace(
            settings.model_id,
            fingerprint,
            settings.engine.block_size,
            str(kv_dtype).removeprefix("torch."),  # the pool's: an fp8 rank never shares blocks with a bf16 one
            settings.weights_digest,
        )
        self.pool = BlockPool(settings.num_blocks, caching=settings.engine.prefix_cache)
        # The model picks: an MLA model takes its own backends (MLA Triton decode on CUDA, else its SDPA path).
        self.attention = model.choose_attention(attention_setting, device, dtype, kv_dtype)
        solo = solo_prefill_tokens(settings, self.attention)
        max_step_tokens = max(settings.engine.max_num_batched_tokens, solo)
        self.attention.context_window_tokens = max_step_tokens
        self.step_cap = StepTokenCap(max_step_tokens, floor=settings.engine.max_num_seqs)
        # L1 extends the prefix cache, so it needs one: without prefix caching there is nothing to key it by.
        self.l1: L1Tier | None = None
        if l1_client is not None and settings.engine.prefix_cache:
            self.l1 = L1Tier(
                l1_client,
                self.kv_cache,
                self.pool,
                self.namespace,
                retry_interval_s=l1_retry_interval_s,
                offload_bytes_per_step=settings.engine.l1_offload_bytes_per_step,
                eviction_horizon_blocks=eviction_horizon_blocks(settings, solo),
                write_through_while_room=settings.engine.l1_write_through == "while_room",
                refresh_finished=settings.engine.l1_refresh_finished,
                save_evicted=settings.engine.l1_write_through == "on_evict",
                reserved_slots=reserved_slots_for(
                    settings.engine.l1_reserved_slots,
                    settings.engine.max_num_batched_tokens,
                    settings.engine.block_size,
                ),
            )
        self.kv = KvCacheManager(self.pool, settings.engine.block_size, self.namespace, self.l1)
        policy = settings.scheduling.model_copy(update={"solo_prefill_tokens": solo})
        self.scheduler = Scheduler(
            self.kv, settings.engine.max_num_seqs, settings.engine.max_num_batched_tokens, policy
        )
        self.runner = ModelRunner(
            model,
            self.kv_cache,
            settings.engine.block_size,
            self.attention,
            max_num_seqs=settings.engine.max_num_seqs,
            max_num_batched_tokens=settings.engine.max_num_batched_tokens,
            max_step_tokens=max_step_tokens,
            max_model_len=settings.max_model_len,
            scratch_block=settings.num_blocks,
            cuda_graphs=settings.engine.cuda_graphs,
            lockstep=lockstep,
        )
        # Kernels compiled and graphs recorded now, not on first use while serving (each costs a request
        # seconds: a Triton compile takes 1-5 s, a graph recording 0.1-0.5 s).
        self.runner.warm_up()
        self.graph_capture_s = self.runner.capture_graphs()
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids if tokenizer else ())
        self.requests: dict[str, Sequence] = {}
        self.finished_requests = 0
        self._last_step_tokens = (0, 0)
        self._last_gpu_s: float | None = None
        self._in_flight: _InFlight | None = None  # pipeline_steps: the step running while the host works
        self._carried: list[RequestOutput] | None = None  # outputs read with a failed row: returned by the next step
        self._last_read = 0.0  # perf_counter when the last step's tokens were read
        self.pipelined_steps = 0  # steps launched before their predecessor was read
        self._unlaunched: ScheduledBatch | None = None  # a successor whose launch failed: run once it is read
        self._plain_next = False  # the next step is scheduled with its predecessor read (preemption allowed)
        self._info = ModelInfo(
            served_model_name=settings.served_model_name,
            model_id=settings.model_id,
            vocab_size=model.cfg.vocab_size,
            max_model_len=settings.max_model_len,
            trained_context_len=settings.trained_context_len,
            block_size=settings.engine.block_size,
            hash_namespace=self.namespace,
            tokenizer=tokenizer,
            model_type=model.cfg.model_type,
        )

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    # --- requests ---

    def validate(self, request: EngineRequest) -> None:
        prompt = request.prompt_token_ids
        limit = self.settings.max_model_len
        params = request.sampling
        if not prompt:
            raise InvalidRequestError("prompt is empty: at least one token is required")
        if len(prompt) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens but max_model_len is {limit}: "
                f"at most {limit - 1} prompt tokens fit, leaving room for one output token"
            )
        vocab = self.model.cfg.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:  # C-speed scan; find the culprit only on failure
            position, token = next((i, t) for i, t in enumerate(prompt) if not 0 <= t < vocab)
            raise InvalidRequestError(f"token id {token} at position {position} is outside the vocabulary [0, {vocab})")
        if params.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {params.max_tokens}")
        if not (math.isfinite(params.temperature) and math.isfinite(params.top_p)):
            raise InvalidRequestError("temperature and top_p must be finite numbers")
        if params.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 <= params.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1] (0 = off), got {params.top_p}")
        if params.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = off), got {params.top_k}")
        for token in params.stop_token_ids:
            if not 0 <= token < vocab:
                raise InvalidRequestError(f"stop token id {token} is outside the vocabulary [0, {vocab})")

    def add_request(self, request: EngineRequest) -> None:
        self.validate(request)
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator(device=self.kv_cache.device).manual_seed(request.sampling.seed)
        seq = Sequence(
            request_id=request.request_id,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling=request.sampling,
            arrival_time=request.arrival_time if request.arrival_time is not None else time.monotonic(),
            generator=generator,
            lookup_hashes=self.kv.sent_prompt_hashes(
                request.prompt_token_ids, request.prompt_block_hashes, request.block_hash_namespace
            ),
        )
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, FinishReason.ABORT)
        return RequestOutput(request_id, [], True, FinishReason.ABORT, None, self._request_stats(seq))

    def has_unfinished(self) -> bool:
        # L1 calls and copies in flight count: someone must step to finish them and let their blocks go.
        return (
            self.scheduler.has_work()
            or self._in_flight is not None
            or self._carried is not None
            or (self.l1 is not None and self.l1.has_pending)
        )

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        if self.l1 is not None:
            self.l1.set_wake(wake)
        if self.lockstep is not None:
            self.lockstep.set_wake(wake)

    def wants_step(self) -> bool:
        return self.lockstep is not None and self.lockstep.wants_step()

    def request_progress(self, request_id: str) -> tuple[int, bool] | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        queued = seq.status in (SequenceStatus.WAITING, SequenceStatus.WAITING_FOR_L1)
        computed = seq.num_computed_tokens
        flight = self._in_flight
        if flight is not None and not flight.advanced:
            computed += flight.members.get(seq, 0)  # launched: the step left running computes them
        return min(computed, seq.num_prompt_tokens), queued

    # --- the step ---

    def step(self) -> list[RequestOutput]:
        """One step's outputs. With pipeline_steps a step is left running and the next call schedules and
        launches its successor (input tokens drawn by the running step taken on the device) before reading it,
        so the host's work between steps (reading, stop checks, delivery, scheduling) overlaps the GPU's.
        In an expert-parallel group a call that launched nothing of its own launches an empty step, so that the
        group's ranks make their agreements (and exchanges) together."""
        if self.lockstep is None:
            return self._step()
        launches = self.runner.launches
        try:
            return self._step()
        finally:
            if self.runner.launches == launches:
                self.runner.launch_empty(busy=self.has_unfinished())

    def _step(self) -> list[RequestOutput]:
        self._last_step_tokens = (0, 0)
        if self._carried is not None:
            outputs, self._carried = self._carried, None
            return outputs
        if self.l1 is not None:
            with phase("l1.poll"):
                self.l1.poll()
        flight = self._in_flight
        if flight is not None:
            self._in_flight = self._launch_successor(flight)
            self._pump_offloads()
            return self._complete(flight)
        batch = self._unlaunched
        self._unlaunched = None
        if batch is not None:  # scheduled as a successor whose launch failed: its inputs are all known now
            batch.entries = [(seq, n) for seq, n in batch.entries if not seq.is_finished]
        else:
            with phase("schedule"):
                batch = self.scheduler.schedule()
        if not batch.entries:
            if self.l1 is not None and self.l1.has_pending:
                self.l1.wait_pending()  # nothing else to do: wait for the copy rather than spin
            return []
        load, started = batch.load, time.perf_counter()  # the load before the step advances its sequences
        with phase("launch"):
            try:
                launched = self.runner.launch(batch)
            except torch.OutOfMemoryError as exc:
                if self.lockstep is not None:
                    raise  # the group's exchanges are out of step: no rank can retry alone
                self._out_of_memory(batch, exc)
                return []
            flight = _InFlight(batch, launched, load, started)
        self._pump_offloads()
        if self.settings.engine.pipeline_steps:
            self._in_flight = flight
            return []
        return self._complete(flight)

    def _out_of_memory(self, batch: ScheduledBatch, exc: torch.OutOfMemoryError) -> None:
        """A step ran out of GPU memory at launch. Nothing of it counted (its sequences advance when it is read, and
        what it wrote of their KV is written again), so it is dropped, and the steps after it carry at most half its
        tokens (step_token_cap.py). One at the floor fails its own requests."""
        tokens = batch.num_tokens
        if not self.step_cap.lower(tokens):
            raise RequestsFailedError([seq.request_id for seq, _ in batch.entries], exc)
        log.warning(
            "a step of %d tokens ran out of GPU memory (%s); dropped, the next steps carry at most %d tokens",
            tokens,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            self.step_cap.tokens,
        )
        self._apply_step_cap()

    def _apply_step_cap(self) -> None:
        self.scheduler.step_token_cap = self.step_cap.tokens
        self.attention.context_window_tokens = self.step_cap.window()  # a window expands as much as a step

    def _pump_offloads(self) -> None:
        """This step's share of the L1 write-through, queued behind its tokens' copy (L1Tier.pump)."""
        if self.l1 is not None:
            with phase("l1.pump"):
                self.l1.pump()

    def _launch_successor(self, flight: _InFlight) -> _InFlight | None:
        """The next step, scheduled and launched before `flight` is read; None when there is nothing to launch or
        the next step should be scheduled with `flight` read (after a step that left someone out for want of
        blocks, so that preemption can make room).

        Each sequence `flight` samples that goes on gets a PENDING_TOKEN in its token_ids, so the scheduler
        counts its next token as it will be; the successor takes those tokens on the device (CarriedTokens)
        and reading `flight` puts them in place. One that ends by length at `flight` is out of the successor.
        One that draws a stop token there is in it anyway: its row is discarded and its blocks go back after
        the successor is read. The successor preempts nobody (`flight` still writes the running sequences'
        blocks): a sequence that gets no blocks sits it out."""
        if not self.settings.engine.pipeline_steps or self._plain_next:
            self._plain_next = False
            return None
        self._advance(flight)
        limit = self.settings.max_model_len
        rows: dict[Sequence, int] = {}
        for row, seq in enumerate(flight.launched.seqs):
            if seq.is_finished:
                continue  # aborted while it ran
            if seq.num_output_tokens + 1 >= seq.sampling.max_tokens or seq.num_tokens + 1 >= limit:
                self.scheduler.end(seq)  # it ends at `flight`, which finishes it when read (its row held till then)
                continue
            flight.pending_at[seq] = seq.num_tokens
            seq.token_ids.append(PENDING_TOKEN)
            rows[seq] = row
        with phase("schedule"):
            batch = self.scheduler.schedule(preempt=False)
        if not batch.entries:
            self._withdraw_pending(flight)
            return None
        self._plain_next = bool(batch.skipped)
        tokens = flight.launched.tokens
        carried = CarriedTokens(tokens, rows) if tokens is not None and rows else None
        load, started = batch.load, time.perf_counter()
        try:
            with phase("launch"):
                launched = self.runner.launch(batch, carried)
        except Exception:  # run the ordinary way once `flight` is read, where its failure is handled
            log.exception("pipelined step launch failed; the step runs after its predecessor is read")
            self._unlaunched = batch
            return None
        self.pipelined_steps += 1
        return _InFlight(batch, launched, load, started)

    @staticmethod
    def _withdraw_pending(flight: _InFlight) -> None:
        """No successor took `flight`'s draws on the device: they are appended when read, as without one."""
        for seq, index in flight.pending_at.items():
            assert seq.token_ids[index] == PENDING_TOKEN and len(seq.token_ids) == index + 1
            seq.token_ids.pop()
        flight.pending_at.clear()

    def _advance(self, flight: _InFlight) -> None:
        """Count the step's tokens as computed and register the blocks they filled (their token ids are known: a
        step computes tokens already in token_ids)."""
        if flight.advanced:
            return
        flight.advanced = True
        for seq, num_new in flight.batch.entries:
            seq.num_computed_tokens += num_new
            # Register full blocks before anything can release them: a finished request must leave its
            # whole prefix behind as cache entries.
            self.kv.register_full_blocks(seq)

    def _complete(self, flight: _InFlight) -> list[RequestOutput]:
        """Read the step's tokens and turn them into outputs."""
        with phase("complete"):
            return self._outputs_of(flight)

    def _outputs_of(self, flight: _InFlight) -> list[RequestOutput]:
        launched, batch = flight.launched, flight.batch
        with phase("read"):
            if not flight.advanced:
                # Nothing has changed yet: a failed draw fails its requests and the others retry the same step.
                tokens, failed = launched.read_all(), {}
            else:
                tokens, failed = launched.read()
                # One that ended while this step ran (its earlier draw failed, say: it was aborted) fails no more.
                failed = {seq: cause for seq, cause in failed.items() if not seq.is_finished}
            if launched.pending is None and self.kv_cache.is_cuda:
                # Mid-prompt chunks only: time the work, not its launch. This step's own end: the stream would
                # hold its successor's work too, and a device-wide sync the L1 write-through on its side stream.
                span = launched.gpu_span
                if isinstance(span, tuple):
                    span[1].synchronize()
                else:
                    torch.cuda.current_stream(self.kv_cache.device).synchronize()
        read = time.perf_counter()
        # A pipelined step's GPU work starts when its predecessor's ends, which is about when that was read.
        self.scheduler.observe_step(flight.load, read - max(flight.started, self._last_read))
        if self.step_cap.ran():
            log.info("step token cap now %s", self.step_cap.tokens or "lifted")
            self._apply_step_cap()
        self._last_read = read
        self._last_gpu_s = span_s(launched.gpu_span)  # type: ignore[arg-type]
        self._last_step_tokens = (batch.num_tokens, sum(n for _, n in batch.entries if n > 1))
        self._advance(flight)
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for seq, _ in batch.entries:
            token = tokens.get(seq)
            if token is None or seq.is_finished:
                continue  # a prefill chunk that is not the prompt's last, a failed draw, or one that left meanwhile
            index = flight.pending_at.get(seq)
            if index is None:
                seq.token_ids.append(token)
            else:
                seq.token_ids[index] = token
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.num_output_tokens == 1:
                self.kv.offload(seq)  # prefill complete: write its blocks through to L1
            reason = self._stop_reason(seq, token)
            new_tokens = [token]
            if reason is FinishReason.STOP:
                seq.stop_token_id = token
                new_tokens = []  # stop tokens end the stream; they are not content
            if reason is None:
                first = seq.num_output_tokens == 1  # the first output also says how much came from cache
                outputs.append(
                    RequestOutput(seq.request_id, new_tokens, stats=self._request_stats(seq) if first else None)
                )
            else:
                self._finish(seq, reason)
                outputs.append(
                    RequestOutput(seq.request_id, new_tokens, True, reason, seq.stop_token_id, self._request_stats(seq))
                )
        for seq in flight.release_after:
            self._release(seq)
        if failed:
            # Its successor is running already, so this step cannot be retried: the others keep their tokens
            # (returned by the next call) and the failed requests fail alone.
            self._carried = outputs
            raise RequestsFailedError([seq.request_id for seq in failed], next(iter(failed.values())))
        return outputs

    def last_step_tokens(self) -> tuple[int, int]:
        return self._last_step_tokens

    def last_step_gpu_s(self) -> float | None:
        seconds, self._last_gpu_s = self._last_gpu_s, None
        return seconds

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.sampling
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.settings.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        # A step still running on the GPU writes this sequence's blocks: they go back once it is read.
        running = self._in_flight if self._in_flight is not None and seq in self._in_flight.members else None
        self.scheduler.remove(seq, release=running is None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        del self.requests[seq.request_id]
        if running is not None:
            running.release_after.append(seq)
        else:
            self.runner.release(seq)
        self.finished_requests += 1

    def _release(self, seq: Sequence) -> None:
        """A finished sequence's blocks and block-table row, after the last step that wrote them was read."""
        self.kv.free(seq, finished=True)
        self.runner.release(seq)

    def _request_stats(self, seq: Sequence) -> RequestStats:
        scheduled = seq.first_scheduled_time
        end = seq.finish_time or time.monotonic()
        return RequestStats(
            prompt_tokens=seq.num_prompt_tokens,
            l0_cached_tokens=seq.num_l0_cached_tokens or 0,
            l1_cached_tokens=seq.num_l1_cached_tokens,
            output_tokens=seq.num_output_tokens,
            queue_wait_s=(scheduled or end) - seq.arrival_time,
            prefill_s=(seq.first_token_time - scheduled) if scheduled and seq.first_token_time else 0.0,
            total_s=end - seq.arrival_time,
            preemptions=seq.preemptions,
        )

    # --- cache plumbing ---

    def drain_kv_events(self) -> list[KvEvent]:
        return self.pool.drain_events()

    def record_stored_block_tokens(self) -> None:
        self.pool.record_stored_tokens = True

    def cached_block_hashes(self) -> list[bytes]:
        return self.pool.cached_hashes()

    def stats(self) -> EngineStats:
        sched = self.scheduler
        return EngineStats(
            total_blocks=self.pool.num_blocks,
            free_blocks=self.pool.num_free,
            cached_blocks=self.pool.num_cached,
            used_blocks=self.pool.num_blocks - self.pool.num_free,
            running=len(sched.running),
            waiting=len(sched.waiting),
            prefix_query_tokens=sched.prefix_query_tokens,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            finished_requests=self.finished_requests,
            preemptions=sched.num_preemptions,
            block_size=self.settings.engine.block_size,
            waiting_prefill_tokens=sched.waiting_prefill_tokens(),
            waiting_warm_prefill_tokens=sched.waiting_warm_prefill_tokens(),
            l1_attached=self.l1 is not None and self.l1.attached,
            l1_restored_tokens=sched.restored_tokens,
            l1_offloaded_blocks=self.l1.offloaded_blocks if self.l1 is not None else 0,
            l1_copies_in_flight=self.l1.copies_in_flight if self.l1 is not None else 0,
            oom_dropped_steps=self.step_cap.dropped_steps,
            step_token_cap=self.step_cap.tokens or 0,
            l1_room_waits=sched.room_waits,
            l1_restore_unstarted_blocks=sched.restore_unstarted_blocks,
            **(self.l1.counts() if self.l1 is not None else {}),
        )

    def close(self) -> None:
        if self.l1 is not None:
            self.l1.close()
        if self.lockstep is not None:
            self.lockstep.close()
