"""Validation of a pushed PEFT LoRA adapter, before a single byte of it is stored.

Checks, in order: the weights file is safetensors (never pickle), its header is well-formed and
consistent with the file size, adapter_config.json is a LoRA config for LLaMA-family projections,
tensor names and shapes match the config (both A [r, in] and B [out, r] per module, r from
r/rank_pattern), the rank is within the store's maximum, shapes fit the base model when it is
registered (FailedPrecondition when the adapter was made for another revision or shape of it),
and every value is finite. Each failure is an InvalidArgument (or FailedPrecondition) naming the
tensor or field at fault.
"""

import dataclasses
import hashlib
import math
import re
import zlib

import safetensors.torch
import torch
from safetensors import SafetensorError

from adapter_store.base_models import BaseModel, load_json_object
from adapter_store.module_patterns import compile_pattern, fullmatches
from adapter_store.safetensors_header import FILE, TensorEntry, parse_header
from loraplex.errors import FailedPrecondition, InvalidArgument

WEIGHTS_FILENAME = FILE
# Projection -> the block that holds it in a LLaMA-family decoder layer.
TARGET_MODULES = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_LORA_KEY_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(\d{1,9})\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
_KEY_FORMAT = "base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight"


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """What the registry records about a valid adapter."""

    base_model: str
    rank: int  # largest rank over r and rank_pattern
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


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    base_model: str
    r: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    revision: str

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    def ranks_of(self, module_names: list[str]) -> dict[str, int]:
        """PEFT's rule per module (peft.utils.other.get_pattern_key), which executors follow too:
        the first rank_pattern key, in the config's order, matching a whole dotted suffix of the
        name (an exact key is one such suffix, not preferred over an earlier one), else r."""
        patterns = list(self.rank_pattern)
        matched = fullmatches(patterns, module_names, "adapter_config.json: rank_pattern keys",
                              as_suffix=True)
        ranks = {}
        for j, name in enumerate(module_names):
            first = next((p for i, p in enumerate(patterns) if matched[i][j]), None)
            ranks[name] = self.r if first is None else self.rank_pattern[first]
        return ranks


def validate_adapter(config_json: str, weights_filename: str, data: bytes, *,
                     max_rank: int | None = None, base: BaseModel | None = None) -> AdapterSpec:
    """Check a pushed adapter; CPU-bound (hash, finiteness), so call it from a worker thread.
    `base`: the registered base model it names, if any."""
    check_weights_file(weights_filename, data)
    entries = parse_header(data)
    config = parse_config(config_json)
    if max_rank is not None and config.max_rank > max_rank:
        raise InvalidArgument(f"adapter_config.json: rank {config.max_rank} (max of r and "
                              f"rank_pattern) exceeds this store's maximum {max_rank}")
    check_tensors(entries, config)
    if base is not None:
        check_base_model(entries, config, base)
    check_finite(data)
    return AdapterSpec(
        base_model=config.base_model, use_rslora=config.use_rslora, alpha=config.alpha,
        rank=config.max_rank, target_modules=config.target_modules, num_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(), crc32=zlib.crc32(data),
        dtype=",".join(sorted({e.dtype for e in entries.values()})),
        rank_pattern=config.rank_pattern, alpha_pattern=config.alpha_pattern,
        base_model_revision=config.revision or (base.revision if base else ""))


def check_base_model(entries: dict[str, TensorEntry], config: LoraConfig, base: BaseModel) -> None:
    """Every tensor fits the registered base model: its layer exists, A is [r, in], B [out, r]."""
    if config.revision and base.revision and config.revision != base.revision:
        raise FailedPrecondition(
            f"adapter_config.json: revision {config.revision!r} of {base.model_id!r} differs from "
            f"the registered revision {base.revision!r}; retrain on it or register that revision")
    for name, entry in sorted(entries.items()):
        match = _LORA_KEY_RE.match(name)
        layer, module, which = int(match[1]), match[3], match[4]
        if layer >= base.num_layers:
            raise FailedPrecondition(f"tensor {name!r}: layer {layer} does not exist in "
                                     f"{base.model_id!r} ({base.num_layers} layers)")
        in_f, out_f = base.module_shapes[module]
        got, want, what = ((entry.shape[1], in_f, "input") if which == "A"
                           else (entry.shape[0], out_f, "output"))
        if got != want:
            raise FailedPrecondition(
                f"tensor {name!r} has shape {list(entry.shape)}: {got} {what} features, but "
                f"{module} of {base.model_id!r} has {want}; was it trained on another model?")


def check_weights_file(weights_filename: str, data: bytes) -> None:
    """Only safetensors is accepted: refuse pickle by name and by content."""
    if weights_filename.endswith(_PICKLE_SUFFIXES):
        raise InvalidArgument(f"weights file {weights_filename!r} is a pickle checkpoint; only "
                              f"safetensors is accepted: save the adapter as {WEIGHTS_FILENAME}")
    if weights_filename != WEIGHTS_FILENAME:
        raise InvalidArgument(f"weights file {weights_filename!r} is not accepted; only "
                              f"safetensors is accepted, named {WEIGHTS_FILENAME}")
    # Pickle starts 0x80 <protocol>, torch's zip format "PK\3\4"; safetensors has '{' at byte 8.
    is_pickle = data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    if (is_pickle or data[:4] == b"PK\x03\x04") and data[8:9] != b"{":
        raise InvalidArgument(f"{WEIGHTS_FILENAME} holds a pickle/torch.save checkpoint; only "
                              "safetensors is accepted (use safetensors.torch.save_file)")


def parse_config(config_json: str) -> LoraConfig:
    """adapter_config.json as PEFT writes it, limited to what loraplex can serve."""
    def invalid(message: str) -> InvalidArgument:
        return InvalidArgument(f"adapter_config.json: {message}")

    raw = load_json_object(config_json, "adapter_config.json")
    if raw.get("peft_type", "LORA") != "LORA":
        raise invalid(f"peft_type {raw['peft_type']!r} is not supported; only LORA is")
    if raw.get("use_dora"):
        raise invalid("use_dora is not supported; push a plain LoRA adapter")
    r = raw.get("r")
    if not _is_int(r) or r <= 0:
        raise invalid(f"r must be a positive integer, got {r!r}")
    alpha = raw.get("lora_alpha")
    if not _is_number(alpha) or alpha <= 0:
        raise invalid(f"lora_alpha must be a positive finite number, got {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise invalid(f"use_rslora must be true or false, got {use_rslora!r}")
    base_model = raw.get("base_model_name_or_path")
    if not isinstance(base_model, str) or not base_model:
        raise invalid("base_model_name_or_path is missing; set it to the base model's name")
    rank_pattern = raw.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict):
        raise invalid("rank_pattern must map module patterns to ranks")
    for pattern, rank in rank_pattern.items():
        if not _is_int(rank) or rank <= 0:
            raise invalid(f"rank_pattern[{pattern!r}] must be a positive integer, got {rank!r}")
        compile_pattern(pattern, "adapter_config.json: rank_pattern key")
    alpha_pattern = raw.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict) or not all(
            _is_number(a) for a in alpha_pattern.values()):
        raise invalid("alpha_pattern must map module patterns to finite numbers")
    for pattern in alpha_pattern:
        compile_pattern(pattern, "adapter_config.json: alpha_pattern key")
    revision = raw.get("revision") or ""
    if not isinstance(revision, str):
        raise invalid(f"revision must be a string, got {revision!r}")
    return LoraConfig(base_model=base_model, r=r, alpha=float(alpha), use_rslora=use_rslora,
                      target_modules=_target_modules(raw.get("target_modules"), invalid),
                      rank_pattern=dict(rank_pattern),
                      alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
                      revision=revision)


def _target_modules(value: object, invalid) -> tuple[str, ...]:
    """A list of projection names, or a string: a name, "all-linear" or a PEFT full-match regex."""
    supported = sorted(TARGET_MODULES)
    if isinstance(value, str):
        if value in TARGET_MODULES:
            return (value,)
        if value == "all-linear":
            return tuple(supported)
        compile_pattern(value, "adapter_config.json: target_modules regex")
        modules = list(TARGET_MODULES)
        (is_match,) = fullmatches([value], [f"model.layers.0.{TARGET_MODULES[m]}.{m}"
                                            for m in modules],
                                  "adapter_config.json: target_modules regex")
        matched = [m for m, hit in zip(modules, is_match) if hit]
        if not matched:
            raise invalid(f"target_modules regex {value!r} matches none of {supported}")
        return tuple(sorted(matched))
    if not isinstance(value, list) or not value:
        raise invalid(f"target_modules must be a non-empty list or a string, got {value!r}")
    for module in value:
        if module not in TARGET_MODULES:
            raise invalid(f"target module {module!r} is not supported; use a subset of {supported}")
    return tuple(sorted(set(value)))


def check_tensors(entries: dict[str, TensorEntry], config: LoraConfig) -> None:
    """Names follow PEFT, every module has A [r, in] and B [out, r], ranks match the config."""
    pairs: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    for name, entry in entries.items():
        match = _LORA_KEY_RE.match(name)
        if not match:
            raise InvalidArgument(f"tensor {name!r} is not a LoRA weight of a LLaMA-family model; "
                                  f"expected {_KEY_FORMAT}")
        layer, block, module, which = int(match[1]), match[2], match[3], match[4]
        if TARGET_MODULES.get(module) != block:
            raise InvalidArgument(f"tensor {name!r}: {block}.{module} is not a LLaMA projection")
        if module not in config.target_modules:
            raise InvalidArgument(f"tensor {name!r} adapts {module}, which is not in "
                                  f"target_modules {list(config.target_modules)}")
        if entry.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(f"tensor {name!r} has dtype {entry.dtype}; LoRA weights must be "
                                  f"one of {sorted(FLOAT_DTYPES)}")
        if len(entry.shape) != 2:
            raise InvalidArgument(f"tensor {name!r} has shape {list(entry.shape)}; LoRA weights "
                                  "are 2-D (A [r, in], B [out, r])")
        pairs.setdefault((layer, module), {})[which] = entry
    if not pairs:
        raise InvalidArgument(f"{WEIGHTS_FILENAME} holds no LoRA tensors")

    prefixes = {key: f"model.layers.{key[0]}.{TARGET_MODULES[key[1]]}.{key[1]}" for key in pairs}
    ranks = config.ranks_of(sorted(prefixes.values()))
    # Executors match alpha_pattern keys the same way: a key that backtracks for ever stops here.
    fullmatches(list(config.alpha_pattern), sorted(prefixes.values()),
                "adapter_config.json: alpha_pattern keys", as_suffix=True)
    dims: dict[str, tuple[int, int]] = {}  # module -> (in, out), equal across layers
    for (layer, module), pair in sorted(pairs.items()):
        prefix = prefixes[layer, module]
        for which, other in (("A", "B"), ("B", "A")):
            if which not in pair:
                raise InvalidArgument(f"module {prefix} has lora_{other} but no lora_{which} "
                                      f"(base_model.model.{prefix}.lora_{which}.weight)")
        a, b = pair["A"], pair["B"]  # a: [r, in], b: [out, r]
        rank = ranks[prefix]
        for entry, got in ((a, a.shape[0]), (b, b.shape[1])):
            if got != rank:
                raise InvalidArgument(
                    f"tensor {entry.name!r} has shape {list(entry.shape)}: rank {got} differs from "
                    f"{rank}, the rank adapter_config.json gives {prefix} (r / rank_pattern)")
        seen = dims.setdefault(module, (a.shape[1], b.shape[0]))
        if seen != (a.shape[1], b.shape[0]):
            raise InvalidArgument(f"module {prefix} maps {a.shape[1]} -> {b.shape[0]} features "
                                  f"but {module} maps {seen[0]} -> {seen[1]} in other layers")
    missing = sorted(set(config.target_modules) - set(dims))
    if missing:
        raise InvalidArgument(f"target_modules lists {missing} but {WEIGHTS_FILENAME} has no "
                              "tensors for them")


def check_finite(data: bytes) -> None:
    """Load with safetensors (never pickle) and refuse NaN or infinite values."""
    try:
        tensors = safetensors.torch.load(data)
    except SafetensorError as exc:
        raise InvalidArgument(f"{WEIGHTS_FILENAME} does not load: {exc}") from None
    for name, tensor in tensors.items():
        if not torch.isfinite(tensor).all():
            count = int((~torch.isfinite(tensor)).sum())
            raise InvalidArgument(f"tensor {name!r} has {count} NaN or infinite values")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
