from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "vocab_size", "max_model_len", "eos_token_ids", "num_kv_blocks", "block_size", "num_adapter_slots", "max_lora_rank", "tokenizer_json", "weight_bytes", "kv_cache_bytes", "adapter_pool_bytes", "lora_backend", "device", "slot_adapters", "num_sequences", "chat_template", "special_tokens", "base_fingerprint", "merged_adapter", "page_geometry", "tensor_parallel_size", "longrope_switch_len", "quantization", "dense_weight_bytes", "kv_kinds", "decode_graph_buckets", "decode_graphs_off")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ADAPTER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SLOT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BASE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MERGED_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PAGE_GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LONGROPE_SWITCH_LEN_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    DENSE_WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_KINDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_GRAPH_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    DECODE_GRAPHS_OFF_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_kv_blocks: int
    block_size: int
    num_adapter_slots: int
    max_lora_rank: int
    tokenizer_json: str
    weight_bytes: int
    kv_cache_bytes: int
    adapter_pool_bytes: int
    lora_backend: str
    device: str
    slot_adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterRef]
    num_sequences: int
    chat_template: str
    special_tokens: _containers.ScalarMap[str, str]
    base_fingerprint: str
    merged_adapter: _common_pb2.AdapterRef
    page_geometry: PageGeometry
    tensor_parallel_size: int
    longrope_switch_len: int
    quantization: str
    dense_weight_bytes: int
    kv_kinds: _containers.RepeatedCompositeFieldContainer[KVKind]
    decode_graph_buckets: _containers.RepeatedScalarFieldContainer[int]
    decode_graphs_off: str
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_adapter_slots: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., tokenizer_json: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., adapter_pool_bytes: _Optional[int] = ..., lora_backend: _Optional[str] = ..., device: _Optional[str] = ..., slot_adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterRef, _Mapping]]] = ..., num_sequences: _Optional[int] = ..., chat_template: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., base_fingerprint: _Optional[str] = ..., merged_adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., page_geometry: _Optional[_Union[PageGeometry, _Mapping]] = ..., tensor_parallel_size: _Optional[int] = ..., longrope_switch_len: _Optional[int] = ..., quantization: _Optional[str] = ..., dense_weight_bytes: _Optional[int] = ..., kv_kinds: _Optional[_Iterable[_Union[KVKind, _Mapping]]] = ..., decode_graph_buckets: _Optional[_Iterable[int]] = ..., decode_graphs_off: _Optional[str] = ...) -> None: ...

class KVKind(_message.Message):
    __slots__ = ("window", "layers", "columns")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    window: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    columns: int
    def __init__(self, window: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., columns: _Optional[int] = ...) -> None: ...

class PageGeometry(_message.Message):
    __slots__ = ("num_layers", "region_elements", "modules", "page_bytes", "layer_groups")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    REGION_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    region_elements: int
    modules: _containers.RepeatedCompositeFieldContainer[ModuleShape]
    page_bytes: int
    layer_groups: int
    def __init__(self, num_layers: _Optional[int] = ..., region_elements: _Optional[int] = ..., modules: _Optional[_Iterable[_Union[ModuleShape, _Mapping]]] = ..., page_bytes: _Optional[int] = ..., layer_groups: _Optional[int] = ...) -> None: ...

class ModuleShape(_message.Message):
    __slots__ = ("module", "in_features", "out_features")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    IN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    OUT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    module: str
    in_features: int
    out_features: int
    def __init__(self, module: _Optional[str] = ..., in_features: _Optional[int] = ..., out_features: _Optional[int] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "sampling", "slot", "num_generated", "num_cached", "request_id", "lora_from", "first_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_FROM_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    slot: int
    num_generated: int
    num_cached: int
    request_id: str
    lora_from: int
    first_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., slot: _Optional[int] = ..., num_generated: _Optional[int] = ..., num_cached: _Optional[int] = ..., request_id: _Optional[str] = ..., lora_from: _Optional[int] = ..., first_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("freed_seq_ids", "new_sequences", "row_seq_ids", "row_num_tokens", "row_num_new_blocks", "new_block_ids", "merge_slot", "unmerge")
    FREED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ROW_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ROW_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROW_NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MERGE_SLOT_FIELD_NUMBER: _ClassVar[int]
    UNMERGE_FIELD_NUMBER: _ClassVar[int]
    freed_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    row_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    row_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    row_num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    merge_slot: int
    unmerge: bool
    def __init__(self, freed_seq_ids: _Optional[_Iterable[int]] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., row_seq_ids: _Optional[_Iterable[int]] = ..., row_num_tokens: _Optional[_Iterable[int]] = ..., row_num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., merge_slot: _Optional[int] = ..., unmerge: _Optional[bool] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("sample_seq_ids", "sample_token_ids", "sample_logprobs", "step_seconds", "sample_num_top", "top_token_ids", "top_logprobs", "prompt_logprobs")
    SAMPLE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sample_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    sample_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample_logprobs: _containers.RepeatedScalarFieldContainer[float]
    step_seconds: float
    sample_num_top: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, sample_seq_ids: _Optional[_Iterable[int]] = ..., sample_token_ids: _Optional[_Iterable[int]] = ..., sample_logprobs: _Optional[_Iterable[float]] = ..., step_seconds: _Optional[float] = ..., sample_num_top: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _common_pb2.TokenLogprobs
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class StageAdapterRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterRef
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ...) -> None: ...

class StageAdapterResponse(_message.Message):
    __slots__ = ("num_bytes", "stage_seconds", "was_staged")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAS_STAGED_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    stage_seconds: float
    was_staged: bool
    def __init__(self, num_bytes: _Optional[int] = ..., stage_seconds: _Optional[float] = ..., was_staged: _Optional[bool] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter", "slot", "only_staged", "pages", "stream_id")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ONLY_STAGED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterRef
    slot: int
    only_staged: bool
    pages: _containers.RepeatedScalarFieldContainer[int]
    stream_id: str
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., slot: _Optional[int] = ..., only_staged: _Optional[bool] = ..., pages: _Optional[_Iterable[int]] = ..., stream_id: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("num_bytes", "load_seconds", "was_resident")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAS_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    load_seconds: float
    was_resident: bool
    def __init__(self, num_bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ..., was_resident: _Optional[bool] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("slot", "adapter", "stream_id")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    slot: int
    adapter: _common_pb2.AdapterRef
    stream_id: str
    def __init__(self, slot: _Optional[int] = ..., adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., stream_id: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrepareGrammarRequest(_message.Message):
    __slots__ = ("grammar",)
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    grammar: _common_pb2.Grammar
    def __init__(self, grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ...) -> None: ...

class PrepareGrammarResponse(_message.Message):
    __slots__ = ("compile_seconds",)
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    compile_seconds: float
    def __init__(self, compile_seconds: _Optional[float] = ...) -> None: ...
