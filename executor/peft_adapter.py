"""Parse a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors bytes) into
LoraWeights for the slot pool, checking it against the base model. Never unpickles anything.

Tensor keys look like
    base_model.model.model.layers.{i}.{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj.lora_{A|B}.weight
(A [r, in], B [out, r]), possibly with an adapter-name infix: `lora_A.default.weight`.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from adapter_store.safetensors_header import parse_header
from executor.lora import LORA_MODULES, LoraModuleWeights, LoraWeights
from executor.model_config import ModelConfig
from loraplex.errors import InvalidArgument

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16, "I16": torch.int16, "F16": torch.float16,
    "BF16": torch.bfloat16, "U32": torch.uint32, "I32": torch.int32, "F32": torch.float32,
    "U64": torch.uint64, "I64": torch.int64, "F64": torch.float64}


class AdapterError(ValueError):
    """The adapter is malformed or does not fit the base model (maps to INVALID_ARGUMENT)."""


class BaseModelMismatchError(AdapterError):
    """The adapter was trained on another base model (maps to FAILED_PRECONDITION)."""


def adapter_rank(config: dict[str, Any]) -> int:
    """Largest rank of any module of the adapter: max of `r` and the `rank_pattern` values."""
    pattern_ranks = (config.get("rank_pattern") or {}).values()
    return max([int(config.get("r", 8)), *(int(r) for r in pattern_ranks)])


def _pattern_value(patterns: dict[str, Any], module_key: str, default: Any) -> Any:
    """PEFT's rule (peft.utils.other.get_pattern_key): first pattern matching the key's tail."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return value
    return default


def _check_config(cfg: dict[str, Any], base: ModelConfig, max_rank: int | None,
                  check_base_model: bool) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter_config.json: peft_type {cfg['peft_type']!r} is not supported "
                           "(only LORA)")
    for flag in ("use_dora", "lora_bias"):
        if cfg.get(flag):
            raise AdapterError(f"adapter_config.json: {flag}=true is not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"adapter_config.json: modules_to_save {cfg['modules_to_save']} is not "
                           "supported (only LoRA on the 7 projections)")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise AdapterError(f"adapter_config.json: r must be a positive integer, got {r!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(field) or {}, dict):
            raise AdapterError(f"adapter_config.json: {field} must be an object")
    for name, value in (cfg.get("rank_pattern") or {}).items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise AdapterError(f"adapter_config.json: rank_pattern[{name!r}] must be a positive "
                               f"integer, got {value!r}")
    for name, value in [("lora_alpha", cfg.get("lora_alpha", 8)),
                        *((f"alpha_pattern[{k!r}]", v)
                          for k, v in (cfg.get("alpha_pattern") or {}).items())]:
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise AdapterError(f"adapter_config.json: {name} must be a finite number, "
                               f"got {value!r}")
    rank = adapter_rank(cfg)
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"adapter rank {rank} exceeds the executor's max rank {max_rank}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in LORA_MODULES]
        if unknown:
            raise AdapterError(f"adapter_config.json: unknown target module {unknown[0]!r} "
                               f"(supported: {', '.join(LORA_MODULES)})")
    wanted = cfg.get("base_model_name_or_path")
    if check_base_model and wanted and wanted.rstrip("/") != base.model_id:
        raise BaseModelMismatchError(
            f"adapter was trained on base model {wanted!r}, this pool serves {base.model_id!r}")


def _load_tensors(data: bytes | torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                       torch.Tensor | None]:
    """Tensors of a safetensors file, as views into `data` when it is a uint8 tensor (the loader's
    staging buffer: no copy); `bytes` are copied once into a tensor first. Also the whole data
    section as one tensor when every tensor has the same floating dtype (they tile it, so one
    reduction over it checks them all), else None."""
    if isinstance(data, torch.Tensor):
        raw = data  # [num_bytes] uint8
    else:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
            0, dtype=torch.uint8)
    head = raw[:2].numpy().tobytes()
    if head[:2] == b"PK" or head[:1] == b"\x80":
        raise AdapterError("adapter_model: looks like a pickle/torch.save file; "
                           "only adapter_model.safetensors is accepted")
    try:
        entries = parse_header(raw.numpy())  # bounds and tiling checked before any view is made
    except InvalidArgument as err:
        raise AdapterError(f"adapter_model.safetensors is malformed or truncated: {err}") from None
    start = 8 + int.from_bytes(raw[:8].numpy().tobytes(), "little")
    tensors = {}
    for name, entry in entries.items():
        dtype = _TORCH_DTYPES[entry.dtype]
        span = raw[start + entry.begin:start + entry.end]
        if (start + entry.begin) % dtype.itemsize:
            span = span.clone()  # misaligned for its dtype: view a copy
        tensors[name] = span.view(dtype).view(entry.shape)
    dtypes = {t.dtype for t in tensors.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    if dtype is None or not dtype.is_floating_point or start % dtype.itemsize:
        return tensors, None
    return tensors, raw[start:].view(dtype)  # [every value of every tensor]


def _is_finite(tensor: torch.Tensor) -> bool:
    """All values finite; min and max propagate NaN, so two reductions decide (no mask)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.dtype.itemsize == 1:  # float8: aminmax has no kernel
        return bool(torch.isfinite(tensor.float()).all())
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def parse_peft_adapter(adapter_config: dict[str, Any], safetensors_bytes: bytes | torch.Tensor,
                       base: ModelConfig, *, max_rank: int | None = None,
                       check_base_model: bool = True,
                       dtype: torch.dtype | None = torch.float32) -> LoraWeights:
    """Validate a PEFT LoRA adapter against `base` and return its per-module weights and scales,
    converted to `dtype` (None: as stored; the slot pool converts while it copies).

    `safetensors_bytes` may be a 1-D uint8 tensor: the weights returned are then views into it
    (when already of `dtype`, or `dtype` is None). Raises AdapterError naming the field or tensor at fault; BaseModelMismatchError when the
    adapter's `base_model_name_or_path` is not `base.model_id`.
    """
    cfg = adapter_config
    _check_config(cfg, base, max_rank, check_base_model)
    tensors, section = _load_tensors(safetensors_bytes)
    # One check for all tensors; tensor by tensor only to name a culprit (or for mixed dtypes).
    are_all_finite = section is not None and _is_finite(section)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"adapter tensor {key!r} is not a LoRA A/B weight of a "
                               "q/k/v/o/gate/up/down projection")
        layer, block, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in LORA_MODULES or (block == "mlp") != (module in _MLP_MODULES):
            raise AdapterError(f"adapter tensor {key!r}: unknown target module {block}.{module}")
        if layer >= base.num_hidden_layers:
            raise AdapterError(f"adapter tensor {key!r}: layer {layer} does not exist "
                               f"(base model has {base.num_hidden_layers} layers)")
        if not are_all_finite and not _is_finite(tensor):
            raise AdapterError(f"adapter tensor {key!r} has non-finite values")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterError("adapter_model.safetensors holds no LoRA weights")

    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    modules = {}
    for (layer, module), ab in sorted(pairs.items()):
        block = "mlp" if module in _MLP_MODULES else "self_attn"
        module_key = f"model.layers.{layer}.{block}.{module}"
        for which in "AB":
            if which not in ab:
                raise AdapterError(f"adapter is missing lora_{which} for {module_key}")
        r = int(_pattern_value(rank_pattern, module_key, cfg["r"]))
        alpha = float(_pattern_value(alpha_pattern, module_key, cfg.get("lora_alpha", 8)))
        in_f, out_f = base.module_shape(module)
        for which, shape in (("A", (r, in_f)), ("B", (out_f, r))):
            if tuple(ab[which].shape) != shape:
                raise AdapterError(f"adapter tensor {module_key}.lora_{which} has shape "
                                   f"{tuple(ab[which].shape)}, expected {shape} (rank {r})")
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        modules[(layer, module)] = LoraModuleWeights(
            a=ab["A"].to(dtype or ab["A"].dtype), b=ab["B"].to(dtype or ab["B"].dtype),
            scale=scale)
    return LoraWeights(modules=modules)
