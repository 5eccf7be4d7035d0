from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VersionMetadata(_message.Message):
    __slots__ = ("training_dataset", "eval_scores", "base_model_revision", "aliases")
    class EvalScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRAINING_DATASET_FIELD_NUMBER: _ClassVar[int]
    EVAL_SCORES_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    training_dataset: str
    eval_scores: _containers.ScalarMap[str, float]
    base_model_revision: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, training_dataset: _Optional[str] = ..., eval_scores: _Optional[_Mapping[str, float]] = ..., base_model_revision: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("name", "owner_tenant", "config_json", "weights_filename", "num_bytes", "metadata", "base_fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_TENANT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FILENAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    owner_tenant: str
    config_json: str
    weights_filename: str
    num_bytes: int
    metadata: VersionMetadata
    base_fingerprint: str
    def __init__(self, name: _Optional[str] = ..., owner_tenant: _Optional[str] = ..., config_json: _Optional[str] = ..., weights_filename: _Optional[str] = ..., num_bytes: _Optional[int] = ..., metadata: _Optional[_Union[VersionMetadata, _Mapping]] = ..., base_fingerprint: _Optional[str] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("name", "owner_tenant", "source_uri", "metadata")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_TENANT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_URI_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    owner_tenant: str
    source_uri: str
    metadata: VersionMetadata
    def __init__(self, name: _Optional[str] = ..., owner_tenant: _Optional[str] = ..., source_uri: _Optional[str] = ..., metadata: _Optional[_Union[VersionMetadata, _Mapping]] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name", "version", "tenant", "alias")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    tenant: str
    alias: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., tenant: _Optional[str] = ..., alias: _Optional[str] = ...) -> None: ...

class GetAdaptersRequest(_message.Message):
    __slots__ = ("queries",)
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[GetAdapterRequest]
    def __init__(self, queries: _Optional[_Iterable[_Union[GetAdapterRequest, _Mapping]]] = ...) -> None: ...

class AdapterAnswer(_message.Message):
    __slots__ = ("info", "error_code", "error_message")
    INFO_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.AdapterInfo
    error_code: int
    error_message: str
    def __init__(self, info: _Optional[_Union[_common_pb2.AdapterInfo, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class GetAdaptersResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[AdapterAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[AdapterAnswer, _Mapping]]] = ...) -> None: ...

class AdapterDetails(_message.Message):
    __slots__ = ("info", "base_model_revision", "base_config_sha256", "dtype", "rank_pattern", "alpha_pattern", "training_dataset", "eval_scores", "source", "aliases")
    class RankPatternEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AlphaPatternEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class EvalScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    INFO_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    BASE_CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RANK_PATTERN_FIELD_NUMBER: _ClassVar[int]
    ALPHA_PATTERN_FIELD_NUMBER: _ClassVar[int]
    TRAINING_DATASET_FIELD_NUMBER: _ClassVar[int]
    EVAL_SCORES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.AdapterInfo
    base_model_revision: str
    base_config_sha256: str
    dtype: str
    rank_pattern: _containers.ScalarMap[str, int]
    alpha_pattern: _containers.ScalarMap[str, float]
    training_dataset: str
    eval_scores: _containers.ScalarMap[str, float]
    source: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, info: _Optional[_Union[_common_pb2.AdapterInfo, _Mapping]] = ..., base_model_revision: _Optional[str] = ..., base_config_sha256: _Optional[str] = ..., dtype: _Optional[str] = ..., rank_pattern: _Optional[_Mapping[str, int]] = ..., alpha_pattern: _Optional[_Mapping[str, float]] = ..., training_dataset: _Optional[str] = ..., eval_scores: _Optional[_Mapping[str, float]] = ..., source: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("tenant", "name", "all_versions", "page_size", "page_token")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    name: str
    all_versions: bool
    page_size: int
    page_token: str
    def __init__(self, tenant: _Optional[str] = ..., name: _Optional[str] = ..., all_versions: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterDetails]
    next_page_token: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterDetails, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class SetAliasRequest(_message.Message):
    __slots__ = ("name", "alias", "version", "tenant", "expected_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    alias: str
    version: int
    tenant: str
    expected_version: int
    def __init__(self, name: _Optional[str] = ..., alias: _Optional[str] = ..., version: _Optional[int] = ..., tenant: _Optional[str] = ..., expected_version: _Optional[int] = ...) -> None: ...

class SetAliasResponse(_message.Message):
    __slots__ = ("previous_version",)
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    previous_version: int
    def __init__(self, previous_version: _Optional[int] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("name", "version", "tenant")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    tenant: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, versions: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterRef
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("info", "chunk", "restart")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.AdapterInfo
    chunk: bytes
    restart: bool
    def __init__(self, info: _Optional[_Union[_common_pb2.AdapterInfo, _Mapping]] = ..., chunk: _Optional[bytes] = ..., restart: _Optional[bool] = ...) -> None: ...

class HostPrewarmRequest(_message.Message):
    __slots__ = ("name", "version", "tenant", "alias")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    tenant: str
    alias: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., tenant: _Optional[str] = ..., alias: _Optional[str] = ...) -> None: ...

class HostPrewarmResponse(_message.Message):
    __slots__ = ("info", "was_cached", "seconds")
    INFO_FIELD_NUMBER: _ClassVar[int]
    WAS_CACHED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.AdapterInfo
    was_cached: bool
    seconds: float
    def __init__(self, info: _Optional[_Union[_common_pb2.AdapterInfo, _Mapping]] = ..., was_cached: _Optional[bool] = ..., seconds: _Optional[float] = ...) -> None: ...

class StoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStatsResponse(_message.Message):
    __slots__ = ("blob_store", "num_adapters", "num_versions", "host_entries", "host_bytes", "host_capacity_bytes", "host_hits", "host_misses", "host_joined", "blob_reads", "blob_bytes_read", "checksum_failures", "host_evictions", "fetches")
    BLOB_STORE_FIELD_NUMBER: _ClassVar[int]
    NUM_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_HITS_FIELD_NUMBER: _ClassVar[int]
    HOST_MISSES_FIELD_NUMBER: _ClassVar[int]
    HOST_JOINED_FIELD_NUMBER: _ClassVar[int]
    BLOB_READS_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    blob_store: str
    num_adapters: int
    num_versions: int
    host_entries: int
    host_bytes: int
    host_capacity_bytes: int
    host_hits: int
    host_misses: int
    host_joined: int
    blob_reads: int
    blob_bytes_read: int
    checksum_failures: int
    host_evictions: int
    fetches: int
    def __init__(self, blob_store: _Optional[str] = ..., num_adapters: _Optional[int] = ..., num_versions: _Optional[int] = ..., host_entries: _Optional[int] = ..., host_bytes: _Optional[int] = ..., host_capacity_bytes: _Optional[int] = ..., host_hits: _Optional[int] = ..., host_misses: _Optional[int] = ..., host_joined: _Optional[int] = ..., blob_reads: _Optional[int] = ..., blob_bytes_read: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., host_evictions: _Optional[int] = ..., fetches: _Optional[int] = ...) -> None: ...

class RegisterBaseModelRequest(_message.Message):
    __slots__ = ("model_id", "config_json", "revision", "fingerprint", "names")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    config_json: str
    revision: str
    fingerprint: str
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., config_json: _Optional[str] = ..., revision: _Optional[str] = ..., fingerprint: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class BaseModelInfo(_message.Message):
    __slots__ = ("model_id", "revision", "config_sha256", "num_layers", "fingerprint", "names")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    revision: str
    config_sha256: str
    num_layers: int
    fingerprint: str
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., revision: _Optional[str] = ..., config_sha256: _Optional[str] = ..., num_layers: _Optional[int] = ..., fingerprint: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class GetBaseModelRequest(_message.Message):
    __slots__ = ("name", "fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class ListBaseModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBaseModelsResponse(_message.Message):
    __slots__ = ("base_models",)
    BASE_MODELS_FIELD_NUMBER: _ClassVar[int]
    base_models: _containers.RepeatedCompositeFieldContainer[BaseModelInfo]
    def __init__(self, base_models: _Optional[_Iterable[_Union[BaseModelInfo, _Mapping]]] = ...) -> None: ...

class ResidencyReport(_message.Message):
    __slots__ = ("holder", "adapters", "ttl_seconds")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    holder: str
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterRef]
    ttl_seconds: float
    def __init__(self, holder: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterRef, _Mapping]]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class ResidencyAck(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    def __init__(self, ttl_seconds: _Optional[float] = ...) -> None: ...
