from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GrammarKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAMMAR_KIND_UNSPECIFIED: _ClassVar[GrammarKind]
    GRAMMAR_KIND_JSON_OBJECT: _ClassVar[GrammarKind]
    GRAMMAR_KIND_JSON_SCHEMA: _ClassVar[GrammarKind]
    GRAMMAR_KIND_REGEX: _ClassVar[GrammarKind]
    GRAMMAR_KIND_CHOICE: _ClassVar[GrammarKind]
    GRAMMAR_KIND_LARK: _ClassVar[GrammarKind]

class BaseMatch(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BASE_MATCH_UNSPECIFIED: _ClassVar[BaseMatch]
    BASE_MATCH_UNREGISTERED: _ClassVar[BaseMatch]
    BASE_MATCH_ID: _ClassVar[BaseMatch]
    BASE_MATCH_NAME: _ClassVar[BaseMatch]
    BASE_MATCH_FINGERPRINT: _ClassVar[BaseMatch]
GRAMMAR_KIND_UNSPECIFIED: GrammarKind
GRAMMAR_KIND_JSON_OBJECT: GrammarKind
GRAMMAR_KIND_JSON_SCHEMA: GrammarKind
GRAMMAR_KIND_REGEX: GrammarKind
GRAMMAR_KIND_CHOICE: GrammarKind
GRAMMAR_KIND_LARK: GrammarKind
BASE_MATCH_UNSPECIFIED: BaseMatch
BASE_MATCH_UNREGISTERED: BaseMatch
BASE_MATCH_ID: BaseMatch
BASE_MATCH_NAME: BaseMatch
BASE_MATCH_FINGERPRINT: BaseMatch

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "top_logprobs", "prompt_logprobs", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    top_logprobs: int
    prompt_logprobs: int
    grammar: Grammar
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "value", "choices")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    kind: GrammarKind
    value: str
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[GrammarKind, str]] = ..., value: _Optional[str] = ..., choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "num_top", "top_token_ids", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_top: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class AdapterRef(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "version", "owner_tenant", "is_public", "base_model", "rank", "alpha", "use_rslora", "target_modules", "num_bytes", "sha256", "created_unix", "config_json", "crc32", "base_model_name_or_path", "base_match", "base_fingerprint", "layers_path", "module_ranks", "alora_invocation_tokens")
    class ModuleRanksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_TENANT_FIELD_NUMBER: _ClassVar[int]
    IS_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_OR_PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MATCH_FIELD_NUMBER: _ClassVar[int]
    BASE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PATH_FIELD_NUMBER: _ClassVar[int]
    MODULE_RANKS_FIELD_NUMBER: _ClassVar[int]
    ALORA_INVOCATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    owner_tenant: str
    is_public: bool
    base_model: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    num_bytes: int
    sha256: str
    created_unix: float
    config_json: str
    crc32: int
    base_model_name_or_path: str
    base_match: BaseMatch
    base_fingerprint: str
    layers_path: str
    module_ranks: _containers.ScalarMap[str, int]
    alora_invocation_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., owner_tenant: _Optional[str] = ..., is_public: _Optional[bool] = ..., base_model: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., use_rslora: _Optional[bool] = ..., target_modules: _Optional[_Iterable[str]] = ..., num_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., created_unix: _Optional[float] = ..., config_json: _Optional[str] = ..., crc32: _Optional[int] = ..., base_model_name_or_path: _Optional[str] = ..., base_match: _Optional[_Union[BaseMatch, str]] = ..., base_fingerprint: _Optional[str] = ..., layers_path: _Optional[str] = ..., module_ranks: _Optional[_Mapping[str, int]] = ..., alora_invocation_tokens: _Optional[_Iterable[int]] = ...) -> None: ...
