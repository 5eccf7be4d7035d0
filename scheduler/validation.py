"""Checks on a Generate request before it is queued: every failure is INVALID_ARGUMENT (or
FAILED_PRECONDITION for a base-model mismatch) with a message that says what to change."""

import dataclasses
from collections.abc import Mapping, Sequence

from common.adapter_pages import module_ranks, plan_pages
from common.adapter_ref import AdapterRef
from common.base_fingerprint import is_same_base, same_model_hint
from common.errors import FailedPrecondition, InvalidArgument
from common.lru import Lru
from common.page_geometry_pb import geometry_from_pb, layout_from_pb
from common.peft.config import parse_config
from common.wire import MAX_CACHE_SALT_CHARS
from protos import common_pb2, executor_pb2


def check_vocabulary(ids: Sequence[int], vocab_size: int) -> None:
    """Every prompt token id is in the model's vocabulary."""
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary "
                              f"(size {vocab_size})")


def check_stop_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Every stop token id is in the model's vocabulary (one outside it could never end the
    output: a typo that silently does nothing)."""
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"stop_token_ids: token id {bad} is outside the vocabulary "
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
    ref = AdapterRef.of(adapter)
    if not is_same_base(adapter, info.model_id, info.base_fingerprint):
        raise FailedPrecondition(f"adapter {ref} was trained for base model "
                                 f"{adapter.base_model!r}, but this pool serves "
                                 f"{info.model_id!r}: send it to a pool of that model. "
                                 + same_model_hint(adapter.base_model, info.model_id))
    if adapter.rank > info.max_lora_rank:
        raise InvalidArgument(f"adapter {ref} has rank {adapter.rank}, above this pool's maximum "
                              f"{info.max_lora_rank}: the executors' --max-rank sets it (loraplex "
                              f"up --executor-args '--max-rank {adapter.rank}')")


@dataclasses.dataclass(frozen=True)
class Servable:
    """An exact adapter version checked to fit the pool, with what the scheduler places it by."""

    ref: AdapterRef
    num_bytes: int
    ranks: Mapping[str, int] | None  # per module, its largest rank (None: executors keep slots)
    num_pages: int  # the pages it takes on the pool's executors (0: they keep fixed slots)
    # an activated LoRA's invocation (common/alora.py); (): a plain adapter
    alora_invocation: tuple[int, ...] = ()


class Servables:
    """Adapter versions made Servable, each planned once (versions never change)."""

    def __init__(self, info: executor_pb2.InfoResponse, max_entries: int = 10_000):
        self._info, self._geometry = info, geometry_from_pb(info)
        self._num_layers = layout_from_pb(info).num_layers  # (the model's)
        self._known: Lru[AdapterRef, Servable] = Lru(max_entries)

    def of(self, adapter: common_pb2.AdapterInfo) -> Servable:
        check_adapter(adapter, self._info)
        ref = AdapterRef.of(adapter)
        known = self._known.get(ref)
        if known is None:
            ranks, pages = None, 0
            if self._geometry is not None:
                ranks = dict(adapter.module_ranks) or module_ranks(
                    parse_config(adapter.config_json), adapter.target_modules,
                    self._num_layers, adapter.layers_path)
                try:
                    pages = plan_pages(ranks, self._geometry).num_pages
                except ValueError as err:  # (its modules are not this model's: Phi-3's qkv_proj)
                    raise FailedPrecondition(f"adapter {ref} does not fit this pool's model "
                                             f"{self._info.model_id!r}: {err}") from None
            known = self._known.put(ref, Servable(ref, adapter.num_bytes, ranks, pages,
                                                  tuple(adapter.alora_invocation_tokens)))
        return known


def check_pages(num_tokens: int, adapter: AdapterRef, num_pages: int,
                info: executor_pb2.InfoResponse) -> None:
    """The request's KV and its adapter's pages fit an executor's blocks together (under window
    blocks, its window kinds' at most: its window and its prompt's, common/kv_layout.py)."""
    layout = layout_from_pb(info)
    blocks = layout.most_blocks(num_tokens, info.block_size, chunk=num_tokens)
    if num_pages and blocks + num_pages > info.num_kv_blocks:
        raise InvalidArgument(
            f"the prompt with max_new_tokens ({num_tokens} tokens: {blocks} KV blocks) and "
            f"adapter {adapter}'s weights ({num_pages} blocks) exceed an executor's "
            f"{info.num_kv_blocks} blocks: shorten the prompt or ask for fewer tokens")
