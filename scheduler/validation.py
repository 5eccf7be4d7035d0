"""Checks on a Generate request before it is queued: every failure is INVALID_ARGUMENT (or
FAILED_PRECONDITION for a base-model mismatch) with a message that says what to change."""

from collections.abc import Sequence

from common.adapter_ref import AdapterRef
from common.base_fingerprint import is_same_base
from common.errors import FailedPrecondition, InvalidArgument
from common.wire import MAX_CACHE_SALT_CHARS
from protos import common_pb2, executor_pb2


def check_prompt(ids: Sequence[int], vocab_size: int) -> None:
    if not ids:
        raise InvalidArgument("prompt is empty: give text or at least one token id")
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary "
                              f"(size {vocab_size})")


def context_limit(info: executor_pb2.InfoResponse) -> int:
    """Most tokens (prompt + output) one sequence may hold."""
    return min(info.max_model_len, info.num_kv_blocks * info.block_size)


def check_cache_salt(salt: str) -> None:
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, "
                              f"got {len(salt)}")


def check_adapter(adapter: common_pb2.AdapterInfo, info: executor_pb2.InfoResponse) -> None:
    """The adapter fits the pool: made for its base (the registered base the store matched it
    to is the pool's model id, or has the fingerprint of the executors' model folder), within
    its rank."""
    ref = AdapterRef(adapter.name, adapter.version)
    if not is_same_base(adapter, info.model_id, info.base_fingerprint):
        raise FailedPrecondition(f"adapter {ref} was trained for base model "
                                 f"{adapter.base_model!r}, but this pool serves "
                                 f"{info.model_id!r}: send it to a pool of that model")
    if adapter.rank > info.max_lora_rank:
        raise InvalidArgument(f"adapter {ref} has rank {adapter.rank}, above this pool's maximum "
                              f"{info.max_lora_rank}")
