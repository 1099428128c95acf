from protos import kv_events_pb2 as _kv_events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "max_tokens", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "session_id", "prompt_block_hashes", "block_hash_namespace")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    session_id: str
    prompt_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_hash_namespace: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., prompt_block_hashes: _Optional[_Iterable[bytes]] = ..., block_hash_namespace: _Optional[bytes] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("prompt_tokens", "l0_cached_tokens", "output_tokens", "queue_wait_s", "prefill_s", "total_s", "preemptions", "l1_cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    L0_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    L1_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    l0_cached_tokens: int
    output_tokens: int
    queue_wait_s: float
    prefill_s: float
    total_s: float
    preemptions: int
    l1_cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., l0_cached_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., queue_wait_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., total_s: _Optional[float] = ..., preemptions: _Optional[int] = ..., l1_cached_tokens: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "l0_cached_tokens", "queue_wait_s", "l1_cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    L0_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    L1_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    l0_cached_tokens: int
    queue_wait_s: float
    l1_cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., l0_cached_tokens: _Optional[int] = ..., queue_wait_s: _Optional[float] = ..., l1_cached_tokens: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "stats", "stop_token_id")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    stats: GenerateStats
    stop_token_id: int
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("computed_prompt_tokens", "queued")
    COMPUTED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    computed_prompt_tokens: int
    queued: bool
    def __init__(self, computed_prompt_tokens: _Optional[int] = ..., queued: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "finished", "progress")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    finished: Finished
    progress: Progress
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("total_blocks", "free_blocks", "cached_blocks", "used_blocks", "running", "waiting", "prefix_query_tokens", "prefix_hit_tokens", "finished_requests", "preemptions", "block_size", "waiting_prefill_tokens", "rank_id", "l1_attached", "l1_restored_tokens", "l1_offloaded_blocks", "l1_copies_in_flight", "waiting_warm_prefill_tokens", "oom_dropped_steps", "step_token_cap", "l1_room_waits", "l0_evicted_blocks", "l0_evicted_unsaved_blocks", "l0_evicted_unsaved_in_flight_blocks", "l0_evicted_unsaved_unoffered_blocks", "l1_fetch_timeouts", "l1_restore_missing_blocks", "l1_restore_room_cut_blocks", "l1_restore_unstarted_blocks", "l1_offer_refused_blocks", "l0_evicted_unsaved_past_held_blocks", "l0_evicted_unsaved_no_slot_blocks")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WAITING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    L1_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    L1_RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    L1_OFFLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L1_COPIES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WAITING_WARM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OOM_DROPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_CAP_FIELD_NUMBER: _ClassVar[int]
    L1_ROOM_WAITS_FIELD_NUMBER: _ClassVar[int]
    L0_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L0_EVICTED_UNSAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L0_EVICTED_UNSAVED_IN_FLIGHT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L0_EVICTED_UNSAVED_UNOFFERED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L1_FETCH_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    L1_RESTORE_MISSING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L1_RESTORE_ROOM_CUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L1_RESTORE_UNSTARTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L1_OFFER_REFUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L0_EVICTED_UNSAVED_PAST_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L0_EVICTED_UNSAVED_NO_SLOT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
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
    rank_id: str
    l1_attached: bool
    l1_restored_tokens: int
    l1_offloaded_blocks: int
    l1_copies_in_flight: int
    waiting_warm_prefill_tokens: int
    oom_dropped_steps: int
    step_token_cap: int
    l1_room_waits: int
    l0_evicted_blocks: int
    l0_evicted_unsaved_blocks: int
    l0_evicted_unsaved_in_flight_blocks: int
    l0_evicted_unsaved_unoffered_blocks: int
    l1_fetch_timeouts: int
    l1_restore_missing_blocks: int
    l1_restore_room_cut_blocks: int
    l1_restore_unstarted_blocks: int
    l1_offer_refused_blocks: int
    l0_evicted_unsaved_past_held_blocks: int
    l0_evicted_unsaved_no_slot_blocks: int
    def __init__(self, total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., finished_requests: _Optional[int] = ..., preemptions: _Optional[int] = ..., block_size: _Optional[int] = ..., waiting_prefill_tokens: _Optional[int] = ..., rank_id: _Optional[str] = ..., l1_attached: _Optional[bool] = ..., l1_restored_tokens: _Optional[int] = ..., l1_offloaded_blocks: _Optional[int] = ..., l1_copies_in_flight: _Optional[int] = ..., waiting_warm_prefill_tokens: _Optional[int] = ..., oom_dropped_steps: _Optional[int] = ..., step_token_cap: _Optional[int] = ..., l1_room_waits: _Optional[int] = ..., l0_evicted_blocks: _Optional[int] = ..., l0_evicted_unsaved_blocks: _Optional[int] = ..., l0_evicted_unsaved_in_flight_blocks: _Optional[int] = ..., l0_evicted_unsaved_unoffered_blocks: _Optional[int] = ..., l1_fetch_timeouts: _Optional[int] = ..., l1_restore_missing_blocks: _Optional[int] = ..., l1_restore_room_cut_blocks: _Optional[int] = ..., l1_restore_unstarted_blocks: _Optional[int] = ..., l1_offer_refused_blocks: _Optional[int] = ..., l0_evicted_unsaved_past_held_blocks: _Optional[int] = ..., l0_evicted_unsaved_no_slot_blocks: _Optional[int] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("served_model_name", "model_id", "vocab_size", "max_model_len", "trained_context_len", "block_size", "hash_namespace", "tokenizer_json", "chat_template", "bos_token_id", "eos_token_ids", "bos_token", "eos_token", "add_bos_token", "model_type")
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TRAINED_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    served_model_name: str
    model_id: str
    vocab_size: int
    max_model_len: int
    trained_context_len: int
    block_size: int
    hash_namespace: bytes
    tokenizer_json: str
    chat_template: str
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token: str
    eos_token: str
    add_bos_token: bool
    model_type: str
    def __init__(self, served_model_name: _Optional[str] = ..., model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., trained_context_len: _Optional[int] = ..., block_size: _Optional[int] = ..., hash_namespace: _Optional[bytes] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., add_bos_token: _Optional[bool] = ..., model_type: _Optional[str] = ...) -> None: ...
