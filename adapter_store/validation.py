"""Validation of a pushed PEFT LoRA adapter, before a single byte of it is stored.

Checks, in order: the weights file is safetensors (never pickle), its header is well-formed and
consistent with the file size, adapter_config.json is a LoRA config for a decoder's projections,
tensor names and shapes match the config (both A [r, in] and B [out, r] per module, r from
r/rank_pattern), the rank (the largest its tensors use) is within the store's maximum, shapes
fit the base model when it is registered (FailedPrecondition when the adapter was made for
another revision or shape of it), and every value is finite. Each failure is an InvalidArgument
(or FailedPrecondition) naming the tensor or field at fault. The format's rules live in
common.peft, which executors load with.
"""

import dataclasses
import hashlib
import logging
import zlib

from adapter_store.base_models import BaseModel
from common.errors import FailedPrecondition, InvalidArgument
from common.peft.config import LoraConfig, parse_config
from common.peft.finite import check_finite
from common.peft.layout import AdapterLayout, check_fits, plan_adapter
from common.peft.safetensors_header import check_weights_file, parse_header

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """What the registry records about a valid adapter."""

    base_model: str
    rank: int  # the largest rank its tensors use (AdapterLayout.rank)
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # sorted
    num_bytes: int
    sha256: str
    crc32: int  # zlib.crc32, what executors check the bytes a store sends them against
    dtype: str  # safetensors dtype of the weights ("F32", "BF16"; "BF16,F32" when mixed)
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    base_model_revision: str  # adapter_config.json's "revision", "" when absent
    layers_path: str  # where its tensors put the decoder layers (AdapterLayout.layers)
    module_ranks: dict[str, int]  # each pool module it adapts -> its largest rank
    alora_invocation_tokens: tuple[int, ...]  # an activated LoRA's invocation; () plain


# How to raise a store's rank limit, told with a refusal.
_RAISE_MAX_RANK = (" (its --max-rank; `loraplex up` gives its stores its executors' --max-rank, "
                   "which executors must raise too: loraplex up --executor-args '--max-rank "
                   "{rank}')")


def check_config_rank(config: LoraConfig, max_rank: int | None) -> None:
    """What a push's header can tell of its rank, before its tensors arrive: over `max_rank`
    only when r and every rank_pattern value are (LoraConfig.lowest_rank). A bigger value may
    name no module of the adapter; check_rank checks the rank itself once the tensors are here."""
    if max_rank is not None and config.lowest_rank > max_rank:
        raise InvalidArgument(f"adapter_config.json: rank {config.lowest_rank} exceeds this "
                              f"store's maximum {max_rank} (r and every rank_pattern value "
                              "do)"
                              + _RAISE_MAX_RANK.format(rank=config.lowest_rank))


def check_rank(layout: AdapterLayout, max_rank: int | None) -> None:
    if max_rank is not None and layout.rank > max_rank:
        raise InvalidArgument(f"adapter rank {layout.rank} (the largest its tensors use) exceeds "
                              f"this store's maximum {max_rank}"
                              + _RAISE_MAX_RANK.format(rank=layout.rank))


def validate_adapter(config_json: str, weights_filename: str, data: bytes, *,
                     max_rank: int | None = None, base: BaseModel | None = None) -> AdapterSpec:
    """Check a pushed adapter; CPU-bound (hash, finiteness), so call it from a worker thread.
    `base`: the registered base model it names, if any."""
    check_weights_file(weights_filename, data[:16])
    entries = parse_header(data)
    config = parse_config(config_json)
    layout = plan_adapter(config, entries)
    check_rank(layout, max_rank)
    if base is not None:
        check_base_model_revision(config.revision, base)
        check_fits(layout, base.shapes)
        outside = [t for t in config.alora_invocation_tokens if t >= base.vocab_size]
        if outside:
            raise FailedPrecondition(f"adapter_config.json: alora_invocation_tokens holds token "
                                     f"id {outside[0]}, outside {base.model_id!r}'s vocabulary "
                                     f"of {base.vocab_size}; was it made for another model?")
    check_finite(data, layout)
    if layout.unserved:  # (once per push; executors load them silently)
        log.info("adapter for %s: LoRA on %d vision-tower / projector modules (%s, ...) is "
                 "stored but never served: text-only input does not run them",
                 config.base_model, len(layout.unserved_modules), layout.unserved_modules[0])
    return AdapterSpec(
        base_model=config.base_model, use_rslora=config.use_rslora, alpha=config.alpha,
        rank=layout.rank, target_modules=layout.target_modules, num_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(), crc32=zlib.crc32(data), dtype=layout.dtype,
        rank_pattern=config.rank_pattern, alpha_pattern=config.alpha_pattern,
        base_model_revision=config.revision or (base.revision if base else ""),
        layers_path=layout.layers, module_ranks=layout.module_ranks(),
        alora_invocation_tokens=config.alora_invocation_tokens)


def check_base_model_revision(revision: str, base: BaseModel) -> None:
    if revision and base.revision and revision != base.revision:
        raise FailedPrecondition(
            f"adapter_config.json: revision {revision!r} of {base.model_id!r} differs from "
            f"the registered revision {base.revision!r}; retrain on it or register that revision")
