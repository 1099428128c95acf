from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_ALL_CLEARED: _ClassVar[KvEventKind]
KV_EVENT_KIND_UNSPECIFIED: KvEventKind
KV_EVENT_KIND_STORED: KvEventKind
KV_EVENT_KIND_REMOVED: KvEventKind
KV_EVENT_KIND_ALL_CLEARED: KvEventKind

class KvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("kind", "block_hashes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    kind: KvEventKind
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, kind: _Optional[_Union[KvEventKind, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("sequence", "events")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, sequence: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...
