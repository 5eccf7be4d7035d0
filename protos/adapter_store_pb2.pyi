from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PushHeader(_message.Message):
    __slots__ = ("name", "owner_tenant", "config_json", "weights_filename", "num_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_TENANT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FILENAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    owner_tenant: str
    config_json: str
    weights_filename: str
    num_bytes: int
    def __init__(self, name: _Optional[str] = ..., owner_tenant: _Optional[str] = ..., config_json: _Optional[str] = ..., weights_filename: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name", "version", "tenant")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    tenant: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterInfo, _Mapping]]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("info", "chunk")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.AdapterInfo
    chunk: bytes
    def __init__(self, info: _Optional[_Union[_common_pb2.AdapterInfo, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...
