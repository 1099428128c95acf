from protos import kv_events_pb2 as _kv_events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AttachRequest(_message.Message):
    __slots__ = ("rank_id", "incarnation", "slot_bytes", "hash_namespace")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HASH_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    incarnation: str
    slot_bytes: int
    hash_namespace: bytes
    def __init__(self, rank_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., slot_bytes: _Optional[int] = ..., hash_namespace: _Optional[bytes] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("arena_id", "arena_path", "arena_bytes", "slot_bytes", "num_slots")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    arena_id: str
    arena_path: str
    arena_bytes: int
    slot_bytes: int
    num_slots: int
    def __init__(self, arena_id: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("rank_id", "arena_id", "block_hashes")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    arena_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, rank_id: _Optional[str] = ..., arena_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("rank_id", "arena_id", "count")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    arena_id: str
    count: int
    def __init__(self, rank_id: _Optional[str] = ..., arena_id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("rank_id", "arena_id", "slots", "gpu_holds", "block_hashes")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    GPU_HOLDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    arena_id: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    gpu_holds: bool
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, rank_id: _Optional[str] = ..., arena_id: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., gpu_holds: _Optional[bool] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("rank_id", "arena_id", "block_hashes")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    arena_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, rank_id: _Optional[str] = ..., arena_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("rank_id", "arena_id", "slots", "restored")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    arena_id: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    restored: bool
    def __init__(self, rank_id: _Optional[str] = ..., arena_id: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., restored: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("arena_id", "arena_bytes", "slot_bytes", "num_slots", "free_slots", "stored_slots", "writing_slots", "pinned_slots", "lookup_blocks", "hit_blocks", "stored_total", "evicted_total", "budget_requested_bytes", "budget_reason")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STORED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WRITING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BUDGET_REQUESTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_REASON_FIELD_NUMBER: _ClassVar[int]
    arena_id: str
    arena_bytes: int
    slot_bytes: int
    num_slots: int
    free_slots: int
    stored_slots: int
    writing_slots: int
    pinned_slots: int
    lookup_blocks: int
    hit_blocks: int
    stored_total: int
    evicted_total: int
    budget_requested_bytes: int
    budget_reason: str
    def __init__(self, arena_id: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., stored_slots: _Optional[int] = ..., writing_slots: _Optional[int] = ..., pinned_slots: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., stored_total: _Optional[int] = ..., evicted_total: _Optional[int] = ..., budget_requested_bytes: _Optional[int] = ..., budget_reason: _Optional[str] = ...) -> None: ...
