from protos import executor_pb2 as _executor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankCommand(_message.Message):
    __slots__ = ("step", "load", "clear", "end_stream", "heartbeat")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    END_STREAM_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    step: _executor_pb2.StepRequest
    load: LoadShard
    clear: ClearSlot
    end_stream: EndStream
    heartbeat: Heartbeat
    def __init__(self, step: _Optional[_Union[_executor_pb2.StepRequest, _Mapping]] = ..., load: _Optional[_Union[LoadShard, _Mapping]] = ..., clear: _Optional[_Union[ClearSlot, _Mapping]] = ..., end_stream: _Optional[_Union[EndStream, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadShard(_message.Message):
    __slots__ = ("slot", "pages", "weights", "scales")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    slot: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    weights: bytes
    scales: _containers.RepeatedCompositeFieldContainer[ModuleScale]
    def __init__(self, slot: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., weights: _Optional[bytes] = ..., scales: _Optional[_Iterable[_Union[ModuleScale, _Mapping]]] = ...) -> None: ...

class ModuleScale(_message.Message):
    __slots__ = ("layer", "module", "scale")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    module: str
    scale: float
    def __init__(self, layer: _Optional[int] = ..., module: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class ClearSlot(_message.Message):
    __slots__ = ("slot",)
    SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    def __init__(self, slot: _Optional[int] = ...) -> None: ...

class EndStream(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankAck(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: str
    def __init__(self, error: _Optional[str] = ...) -> None: ...
