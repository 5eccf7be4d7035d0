from protos import common_pb2 as _common_pb2
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
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason

class ModelRequest(_message.Message):
    __slots__ = ("known_fingerprint",)
    KNOWN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    known_fingerprint: str
    def __init__(self, known_fingerprint: _Optional[str] = ...) -> None: ...

class ModelResponse(_message.Message):
    __slots__ = ("model_id", "max_model_len", "vocab_size", "max_lora_rank", "tokenizer_json", "chat_template", "special_tokens", "eos_token_ids", "fingerprint")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    max_model_len: int
    vocab_size: int
    max_lora_rank: int
    tokenizer_json: str
    chat_template: str
    special_tokens: _containers.ScalarMap[str, str]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    fingerprint: str
    def __init__(self, model_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class PrewarmRequest(_message.Message):
    __slots__ = ("adapter", "num_executors", "pin", "wait")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    NUM_EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    num_executors: int
    pin: bool
    wait: bool
    def __init__(self, adapter: _Optional[str] = ..., num_executors: _Optional[int] = ..., pin: _Optional[bool] = ..., wait: _Optional[bool] = ...) -> None: ...

class PrewarmResponse(_message.Message):
    __slots__ = ("adapter", "executors")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterRef
    executors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., executors: _Optional[_Iterable[str]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("adapter", "executor")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    executor: str
    def __init__(self, adapter: _Optional[str] = ..., executor: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("num_evicted",)
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    num_evicted: int
    def __init__(self, num_evicted: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("executor",)
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    executor: str
    def __init__(self, executor: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("running",)
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    running: int
    def __init__(self, running: _Optional[int] = ...) -> None: ...

class MergeRequest(_message.Message):
    __slots__ = ("adapter", "num_executors")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    NUM_EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    num_executors: int
    def __init__(self, adapter: _Optional[str] = ..., num_executors: _Optional[int] = ...) -> None: ...

class MergeResponse(_message.Message):
    __slots__ = ("adapter", "executors")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterRef
    executors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., executors: _Optional[_Iterable[str]] = ...) -> None: ...

class UnmergeRequest(_message.Message):
    __slots__ = ("adapter", "executor")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    executor: str
    def __init__(self, adapter: _Optional[str] = ..., executor: _Optional[str] = ...) -> None: ...

class UnmergeResponse(_message.Message):
    __slots__ = ("executors",)
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    executors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, executors: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("executor",)
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    executor: str
    def __init__(self, executor: _Optional[str] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    def __init__(self, queued: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("adapter", "text", "token_ids", "sampling", "max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "cache_salt", "adapter_ref", "request_id", "include_stop_str", "show_special_tokens")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_REF_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_FIELD_NUMBER: _ClassVar[int]
    SHOW_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    text: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    cache_salt: str
    adapter_ref: _common_pb2.AdapterRef
    request_id: str
    include_stop_str: bool
    show_special_tokens: bool
    def __init__(self, adapter: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., adapter_ref: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., request_id: _Optional[str] = ..., include_stop_str: _Optional[bool] = ..., show_special_tokens: _Optional[bool] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("submits", "cancels")
    SUBMITS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    submits: _containers.RepeatedCompositeFieldContainer[StreamSubmit]
    cancels: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, submits: _Optional[_Iterable[_Union[StreamSubmit, _Mapping]]] = ..., cancels: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamSubmit(_message.Message):
    __slots__ = ("id", "request", "tenant", "timeout_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: GenerateRequest
    tenant: str
    timeout_seconds: float
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., tenant: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("token_request_ids", "token_ids", "logprobs", "starts", "ends", "token_num_top", "top_token_ids", "top_logprobs")
    TOKEN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_request_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    starts: _containers.RepeatedCompositeFieldContainer[StreamStart]
    ends: _containers.RepeatedCompositeFieldContainer[StreamEnd]
    token_num_top: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_request_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., starts: _Optional[_Iterable[_Union[StreamStart, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[StreamEnd, _Mapping]]] = ..., token_num_top: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StreamStart(_message.Message):
    __slots__ = ("id", "queue_seconds", "time_to_first_token_seconds", "prompt_logprobs", "cached_prompt_tokens", "adapter_inactive")
    ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_INACTIVE_FIELD_NUMBER: _ClassVar[int]
    id: int
    queue_seconds: float
    time_to_first_token_seconds: float
    prompt_logprobs: _common_pb2.TokenLogprobs
    cached_prompt_tokens: int
    adapter_inactive: bool
    def __init__(self, id: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ..., adapter_inactive: _Optional[bool] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("id", "finish_reason", "error_code", "error_message", "retry_after")
    ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    id: int
    finish_reason: FinishReason
    error_code: int
    error_message: str
    retry_after: str
    def __init__(self, id: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., retry_after: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_id", "logprob", "text", "finish_reason", "usage", "top_logprobs", "prompt_tokens", "adapter_inactive", "token_text", "stop_string", "stop_token_id")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_INACTIVE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXT_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    finish_reason: FinishReason
    usage: Usage
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    prompt_tokens: _containers.RepeatedCompositeFieldContainer[PromptToken]
    adapter_inactive: bool
    token_text: str
    stop_string: str
    stop_token_id: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., prompt_tokens: _Optional[_Iterable[_Union[PromptToken, _Mapping]]] = ..., adapter_inactive: _Optional[bool] = ..., token_text: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class PromptToken(_message.Message):
    __slots__ = ("token_id", "logprob", "text", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "queue_seconds", "time_to_first_token_seconds", "adapter", "cached_prompt_tokens", "adapter_inactive")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_INACTIVE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    queue_seconds: float
    time_to_first_token_seconds: float
    adapter: _common_pb2.AdapterRef
    cached_prompt_tokens: int
    adapter_inactive: bool
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ..., adapter_inactive: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SlotStats(_message.Message):
    __slots__ = ("adapter", "state", "pins", "is_admin_pinned", "reserved_for", "num_pages")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    IS_ADMIN_PINNED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FOR_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterRef
    state: str
    pins: int
    is_admin_pinned: bool
    reserved_for: _common_pb2.AdapterRef
    num_pages: int
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., state: _Optional[str] = ..., pins: _Optional[int] = ..., is_admin_pinned: _Optional[bool] = ..., reserved_for: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., num_pages: _Optional[int] = ...) -> None: ...

class ExecutorStats(_message.Message):
    __slots__ = ("address", "running", "free_kv_blocks", "num_kv_blocks", "slots", "steps", "adapter_loads", "adapter_hits", "queued", "is_draining", "is_drained", "is_up", "cached_kv_blocks", "dedicated_to", "is_merged", "adapter_pages", "page_bytes", "adapter_evictions", "adapter_early_evictions", "kv_blocks_behind_windows", "quantization", "quantized_freed_bytes", "quantized_freed_kv_tokens", "quantized_freed_blocks", "decode_graph_buckets", "decode_graphs_off", "preemptions")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LOADS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_HITS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    IS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    IS_DRAINED_FIELD_NUMBER: _ClassVar[int]
    IS_UP_FIELD_NUMBER: _ClassVar[int]
    CACHED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEDICATED_TO_FIELD_NUMBER: _ClassVar[int]
    IS_MERGED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_EARLY_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_BEHIND_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_FREED_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_GRAPH_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    DECODE_GRAPHS_OFF_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    address: str
    running: int
    free_kv_blocks: int
    num_kv_blocks: int
    slots: _containers.RepeatedCompositeFieldContainer[SlotStats]
    steps: int
    adapter_loads: int
    adapter_hits: int
    queued: int
    is_draining: bool
    is_drained: bool
    is_up: bool
    cached_kv_blocks: int
    dedicated_to: _common_pb2.AdapterRef
    is_merged: bool
    adapter_pages: int
    page_bytes: int
    adapter_evictions: int
    adapter_early_evictions: int
    kv_blocks_behind_windows: int
    quantization: str
    quantized_freed_bytes: int
    quantized_freed_kv_tokens: int
    quantized_freed_blocks: int
    decode_graph_buckets: _containers.RepeatedScalarFieldContainer[int]
    decode_graphs_off: str
    preemptions: int
    def __init__(self, address: _Optional[str] = ..., running: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SlotStats, _Mapping]]] = ..., steps: _Optional[int] = ..., adapter_loads: _Optional[int] = ..., adapter_hits: _Optional[int] = ..., queued: _Optional[int] = ..., is_draining: _Optional[bool] = ..., is_drained: _Optional[bool] = ..., is_up: _Optional[bool] = ..., cached_kv_blocks: _Optional[int] = ..., dedicated_to: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., is_merged: _Optional[bool] = ..., adapter_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., adapter_evictions: _Optional[int] = ..., adapter_early_evictions: _Optional[int] = ..., kv_blocks_behind_windows: _Optional[int] = ..., quantization: _Optional[str] = ..., quantized_freed_bytes: _Optional[int] = ..., quantized_freed_kv_tokens: _Optional[int] = ..., quantized_freed_blocks: _Optional[int] = ..., decode_graph_buckets: _Optional[_Iterable[int]] = ..., decode_graphs_off: _Optional[str] = ..., preemptions: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "queued", "running", "virtual_counter", "requests", "prompt_tokens", "completion_tokens", "adapter_loads_caused", "cached_prompt_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_COUNTER_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LOADS_CAUSED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    queued: int
    running: int
    virtual_counter: float
    requests: int
    prompt_tokens: int
    completion_tokens: int
    adapter_loads_caused: int
    cached_prompt_tokens: int
    def __init__(self, tenant: _Optional[str] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., virtual_counter: _Optional[float] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., adapter_loads_caused: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("executors", "tenants")
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    def __init__(self, executors: _Optional[_Iterable[_Union[ExecutorStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ...) -> None: ...
