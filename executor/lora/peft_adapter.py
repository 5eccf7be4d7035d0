"""Read a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors bytes) into
LoraWeights for the slot pool, by the format's one definition (common.peft), checked against the
served model. Never unpickles anything; the weights are views into the bytes given."""

from __future__ import annotations

import torch

from common.errors import FailedPrecondition, InvalidArgument
from common.peft.config import parse_config
from common.peft.finite import check_finite
from common.peft.layout import BaseShapes, check_fits, plan_adapter
from common.peft.safetensors_header import WEIGHTS_FILE, check_weights_file, parse_header
from common.peft.tensors import as_uint8, expert_tensors, tensor_views
from executor.lora.slot_pool import LoraModuleWeights, LoraWeights
from executor.model.config import ModelConfig


def model_shapes(model: ModelConfig) -> BaseShapes:
    return BaseShapes(model.model_id, model.num_hidden_layers, model.projection_shapes(),
                      frozenset(model.moe_layers), model.gate_up_interleaved)


def parse_peft_adapter(config_json: str, safetensors_bytes: bytes | torch.Tensor,
                       model: ModelConfig, *, max_rank: int | None = None,
                       check_base_model: bool = True,
                       dtype: torch.dtype | None = torch.float32) -> LoraWeights:
    """The adapter's per-module weights and scales, converted to `dtype` (None: as stored; the
    slot pool converts while it copies). `safetensors_bytes` may be a 1-D uint8 tensor (the
    loader's staging buffer): the weights are then views into it when no conversion is needed.

    INVALID_ARGUMENT naming the field or tensor at fault; FAILED_PRECONDITION when the adapter was
    made for another base model: its base_model_name_or_path is not `model.model_id` (with
    `check_base_model`), or its layers and shapes do not fit the model.
    """
    config = parse_config(config_json)
    outside = [t for t in config.alora_invocation_tokens if t >= model.vocab_size]
    if outside:
        raise FailedPrecondition(f"adapter_config.json: alora_invocation_tokens holds token id "
                                 f"{outside[0]}, outside the model's vocabulary of "
                                 f"{model.vocab_size}")
    wanted = config.base_model.rstrip("/")
    if check_base_model and wanted != model.model_id:
        raise FailedPrecondition(f"adapter was trained on base model {wanted!r}, this pool "
                                 f"serves {model.model_id!r}")
    raw = as_uint8(safetensors_bytes)
    data = raw.numpy()
    check_weights_file(WEIGHTS_FILE, data[:16].tobytes())
    layout = plan_adapter(config, parse_header(data))
    if max_rank is not None and layout.rank > max_rank:
        raise InvalidArgument(f"adapter rank {layout.rank} exceeds the executor's max rank "
                              f"{max_rank}")
    check_fits(layout, model_shapes(model))
    check_finite(data, layout)
    views = {key: (a, b, layout.modules[key].scale)
             for key, (a, b) in tensor_views(raw, layout).items()}
    views.update(expert_tensors(raw, layout))
    return LoraWeights(modules={
        key: LoraModuleWeights(a=a.to(dtype or a.dtype), b=b.to(dtype or b.dtype), scale=scale)
        for key, (a, b, scale) in views.items()})
