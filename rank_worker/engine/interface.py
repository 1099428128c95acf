"""What an engine rank must offer the worker around it (ours, or another such as a DeepInfer rank).

The worker drives one Engine from a single thread: add/abort between steps, step() in a loop while
there is work, drain_kv_events() after each step. validate() is pure and may be called from any thread.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from contracts.kv_events import KvEvent


class InvalidRequestError(ValueError):
    """A request the engine refuses as given (maps to INVALID_ARGUMENT / HTTP 400)."""


class RequestsFailedError(RuntimeError):
    """step() could not serve these requests (their own parameters or data). The engine is intact and the
    step's tokens were not applied: the worker aborts these requests alone and steps again for the others."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"request(s) {request_ids} failed: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float | None = None  # time.monotonic(); set by add_request when None
    # The client's chained hashes of the prompt's full blocks and the namespace it computed them in: used
    # instead of hashing the prompt again when that is the engine's namespace and the count is right.
    prompt_block_hashes: list[bytes] = field(default_factory=list)
    block_hash_namespace: bytes = b""


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    l0_cached_tokens: int = 0  # served from the L0 prefix cache (GPU); cached in all: l0 + l1
    output_tokens: int = 0
    queue_wait_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0
    preemptions: int = 0
    l1_cached_tokens: int = 0  # restored from the L1 host cache (after the L0 ones, not counted in them)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    stats: RequestStats | None = None  # set on the first output (partial) and when finished


@dataclass
class EngineStats:
    total_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    running: int
    waiting: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    finished_requests: int
    preemptions: int
    block_size: int
    waiting_prefill_tokens: int
    waiting_warm_prefill_tokens: int = 0  # the part of it a new warm request would wait for
    l1_attached: bool = False
    l1_restored_tokens: int = 0
    l1_offloaded_blocks: int = 0
    l1_copies_in_flight: int = 0
    oom_dropped_steps: int = 0  # steps that ran out of GPU memory and were scheduled again smaller
    step_token_cap: int = 0  # the cap those left on a step's tokens (step_token_cap.py); 0: none
    l1_room_waits: int = 0  # steps whose admission waited for room to restore a request's L1 blocks whole
    l0_evicted_blocks: int = 0  # L0 cache entries evicted while L1 was attached ...
    l0_evicted_unsaved_blocks: int = 0  # ... and those of them L1 did not hold: lost to both tiers ...
    l0_evicted_unsaved_in_flight_blocks: int = 0  # ... of which on their way to L1 (offered, not copied yet)
    l0_evicted_unsaved_unoffered_blocks: int = 0  # ... of which the eviction horizon had not offered ...
    l0_evicted_unsaved_past_held_blocks: int = 0  # ... of which while blocks it offered were held out of the free queue
    l1_fetch_timeouts: int = 0  # L1 lookups given up at their deadline: their blocks computed instead
    l1_restore_missing_blocks: int = 0  # blocks L1's event stream promised at a lookup's start, not in its answer
    l1_restore_room_cut_blocks: int = 0  # blocks a lookup found that the free pool had no room for by its answer
    l1_restore_unstarted_blocks: int = 0  # blocks L1 held past an admitted prompt's L0 prefix, not looked up: no room
    l1_offer_refused_blocks: int = 0  # offers the kvstore gave no slot for while L1 was not known to hold the block
    l0_evicted_unsaved_no_slot_blocks: int = 0  # on_evict: evictions L1 lacked with no reserved slot in hand


@dataclass(frozen=True)
class TokenizerBundle:
    """Everything a client needs to turn messages into token ids the way this model expects."""

    tokenizer_json: str
    chat_template: str = ""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token: str = ""
    eos_token: str = ""
    add_bos_token: bool = False


@dataclass(frozen=True)
class ModelInfo:
    served_model_name: str
    model_id: str
    vocab_size: int
    max_model_len: int
    trained_context_len: int
    block_size: int
    hash_namespace: bytes
    tokenizer: TokenizerBundle | None
    model_type: str = ""  # config.json model_type: the gateway's prompt format follows the model family


class Engine(ABC):
    @property
    @abstractmethod
    def model_info(self) -> ModelInfo: ...

    @abstractmethod
    def validate(self, request: EngineRequest) -> None:
        """Raise InvalidRequestError with a clear message; never touches engine state."""

    @abstractmethod
    def add_request(self, request: EngineRequest) -> None: ...

    @abstractmethod
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its blocks; returns its final output if it was known."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step + forward pass; new tokens and finished requests."""

    @abstractmethod
    def drain_kv_events(self) -> list[KvEvent]: ...

    @abstractmethod
    def cached_block_hashes(self) -> list[bytes]:
        """Every hash in the prefix cache now (a snapshot for a subscriber that joins late)."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    def request_progress(self, request_id: str) -> tuple[int, bool] | None:
        """(prompt tokens computed, still queued) of a request the engine holds; None if unknown."""
        return None  # an engine that cannot tell: its requests are reported queued

    def record_stored_block_tokens(self) -> None:
        """From now on, STORED events carry their chain's parent hash and token ids (KvEvent.parent_block_hash,
        token_ids): the worker asks for them when it publishes vLLM-format KV events. An engine that cannot
        tell publishes STORED events without them (vLLM's subscribers then see empty token_ids)."""
        return None

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """The worker's way to be told, from any thread, that the engine has work no request brought (an L1
        answer, the kvstore gone): after wake() it steps the engine even when idle."""
        return None  # an engine with nothing outside its own thread never needs it

    def wants_step(self) -> bool:
        """Whether the engine must be stepped although it holds nothing unfinished: an expert-parallel group's
        other ranks are working, and its MoE layers need this rank in every step (PagedEngine's lockstep)."""
        return False

    def last_step_tokens(self) -> tuple[int, int]:
        """(tokens computed, of which prefill tokens) in the last step, for step timing; (0, 0) if unknown."""
        return (0, 0)

    def last_step_gpu_s(self) -> float | None:
        """The GPU's own time for the last step's forward (CUDA events), for step timing; None if unknown."""
        return None

    def close(self) -> None:
        """Let go of outside resources (an L1 arena mapping, connections) once the engine loop has stopped."""
        return None  # an engine that holds none has nothing to do
