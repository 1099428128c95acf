from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankLoad(_message.Message):
    __slots__ = ("running", "waiting", "waiting_prefill_tokens", "free_blocks", "total_blocks", "waiting_warm_prefill_tokens")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_WARM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    waiting_prefill_tokens: int
    free_blocks: int
    total_blocks: int
    waiting_warm_prefill_tokens: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., waiting_prefill_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., waiting_warm_prefill_tokens: _Optional[int] = ...) -> None: ...

class ExpertParallelPlace(_message.Message):
    __slots__ = ("group", "rank", "size")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    group: str
    rank: int
    size: int
    def __init__(self, group: _Optional[str] = ..., rank: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class RegisterRankRequest(_message.Message):
    __slots__ = ("rank_id", "address", "incarnation", "block_size", "hash_namespace", "load", "expert_parallel")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    address: str
    incarnation: str
    block_size: int
    hash_namespace: bytes
    load: RankLoad
    expert_parallel: ExpertParallelPlace
    def __init__(self, rank_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_namespace: _Optional[bytes] = ..., load: _Optional[_Union[RankLoad, _Mapping]] = ..., expert_parallel: _Optional[_Union[ExpertParallelPlace, _Mapping]] = ...) -> None: ...

class RegisterRankResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("rank_id", "incarnation", "load", "expert_parallel")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    incarnation: str
    load: RankLoad
    expert_parallel: ExpertParallelPlace
    def __init__(self, rank_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., load: _Optional[_Union[RankLoad, _Mapping]] = ..., expert_parallel: _Optional[_Union[ExpertParallelPlace, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "block_hashes", "prompt_tokens", "avoid_rank_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AVOID_RANK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prompt_tokens: int
    avoid_rank_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., prompt_tokens: _Optional[int] = ..., avoid_rank_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("rank_id", "address", "expected_l0_tokens", "expected_l1_tokens", "reason")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_L0_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_L1_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    address: str
    expected_l0_tokens: int
    expected_l1_tokens: int
    reason: str
    def __init__(self, rank_id: _Optional[str] = ..., address: _Optional[str] = ..., expected_l0_tokens: _Optional[int] = ..., expected_l1_tokens: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ListRanksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank_id", "address", "healthy", "load", "l0_blocks", "last_heartbeat_age_s", "expert_parallel")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    L0_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    address: str
    healthy: bool
    load: RankLoad
    l0_blocks: int
    last_heartbeat_age_s: float
    expert_parallel: ExpertParallelPlace
    def __init__(self, rank_id: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., load: _Optional[_Union[RankLoad, _Mapping]] = ..., l0_blocks: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., expert_parallel: _Optional[_Union[ExpertParallelPlace, _Mapping]] = ...) -> None: ...

class ListRanksResponse(_message.Message):
    __slots__ = ("ranks", "l1_blocks", "redis_connected", "sessions")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    L1_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REDIS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    l1_blocks: int
    redis_connected: bool
    sessions: int
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., l1_blocks: _Optional[int] = ..., redis_connected: _Optional[bool] = ..., sessions: _Optional[int] = ...) -> None: ...

class ReportRankFailureRequest(_message.Message):
    __slots__ = ("rank_id", "detail", "request_id")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    detail: str
    request_id: str
    def __init__(self, rank_id: _Optional[str] = ..., detail: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReportRankFailureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportFinishedRequest(_message.Message):
    __slots__ = ("session_id", "rank_id", "prompt_tokens", "l0_cached_tokens", "l1_cached_tokens", "output_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    L0_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    L1_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    rank_id: str
    prompt_tokens: int
    l0_cached_tokens: int
    l1_cached_tokens: int
    output_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., rank_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., l0_cached_tokens: _Optional[int] = ..., l1_cached_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class ReportFinishedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("session_id", "rank_id", "calls", "prompt_tokens", "l0_cached_tokens", "l1_cached_tokens", "computed_tokens", "output_tokens", "cache_hit", "cold_prefills", "first_seen_unix_s", "last_seen_unix_s", "ranks_used")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    L0_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    L1_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    COLD_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    RANKS_USED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    rank_id: str
    calls: int
    prompt_tokens: int
    l0_cached_tokens: int
    l1_cached_tokens: int
    computed_tokens: int
    output_tokens: int
    cache_hit: float
    cold_prefills: int
    first_seen_unix_s: float
    last_seen_unix_s: float
    ranks_used: int
    def __init__(self, session_id: _Optional[str] = ..., rank_id: _Optional[str] = ..., calls: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., l0_cached_tokens: _Optional[int] = ..., l1_cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cache_hit: _Optional[float] = ..., cold_prefills: _Optional[int] = ..., first_seen_unix_s: _Optional[float] = ..., last_seen_unix_s: _Optional[float] = ..., ranks_used: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "tracked", "warm_prefix_fraction")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TRACKED_FIELD_NUMBER: _ClassVar[int]
    WARM_PREFIX_FRACTION_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStats]
    tracked: int
    warm_prefix_fraction: float
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionStats, _Mapping]]] = ..., tracked: _Optional[int] = ..., warm_prefix_fraction: _Optional[float] = ...) -> None: ...
