"""A mixture of experts' tensors in a checkpoint (executor/model/weights.py loads them): the names
checkpoints give them, fused experts cut per expert, gpt-oss's MXFP4 experts dequantized, and a
layer's router and experts assembled as LayerWeights' fields.
"""

from __future__ import annotations

import re

import torch

from executor.model.config import ModelConfig
from executor.model.mxfp4 import dequantize_mxfp4

# Mixtral's names of its MoE block and experts' projections -> the ones loaded (see above)
_MIXTRAL_EXPERT = re.compile(r"(\.experts\.\d+\.)(w1|w3|w2)(\.weight)$")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Experts already fused: model.layers.{i}.mlp.experts.{gate_up_proj|down_proj}
FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def expert_name(name: str) -> str:
    """A checkpoint's name of an MoE layer's tensor as loaded: Mixtral's block_sparse_moe is mlp,
    its w1 / w3 / w2 gate_proj / up_proj / down_proj."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(lambda m: m[1] + _MIXTRAL_PARTS[m[2]] + m[3], name)


def split_experts(name: str, tensor: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """A fused expert weight ([E, 2 I, hidden] gate_up_proj or [E, hidden, I] down_proj) as each
    expert's tensors by their per-expert names."""
    prefix, which = FUSED_EXPERTS.fullmatch(name).groups()
    e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    want = (e, 2 * i, h) if which == "gate_up_proj" else (e, h, i)
    if tuple(tensor.shape) != want:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want} from "
                         "the model config")
    if which == "down_proj":
        return {f"{prefix}.{x}.down_proj.weight": tensor[x] for x in range(e)}
    return {f"{prefix}.{x}.{part}_proj.weight": tensor[x, k * i:(k + 1) * i]
            for x in range(e) for k, part in enumerate(("gate", "up"))}


class Whole:
    """A tensor made at load (a dequantized one) read as a safetensors slice handle reads."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __getitem__(self, index) -> torch.Tensor:
        return self._tensor[index]


def dequantized(f, stored: str, name: str,
                want: tuple[int, ...]) -> tuple[str, torch.Tensor]:
    """(the weight's name, the weight as HF keeps it, transposed: [E, in, out] = `want`) of an
    MXFP4 `{name}_blocks` tensor and its `_scales` beside it in the same file."""
    base = name.removesuffix("_blocks")
    weight = base.rsplit(".", 1)[-1]
    if weight not in ("gate_up_proj", "down_proj") or ".mlp.experts." not in base:
        raise ValueError(f"tensor {stored!r}: MXFP4 is read for gpt-oss's experts only")
    scales = stored.removesuffix("_blocks") + "_scales"
    if scales not in f.keys():  # noqa: SIM118
        raise ValueError(f"tensor {stored!r}: its scales {scales!r} are not beside it")
    values = dequantize_mxfp4(f.get_tensor(stored), f.get_tensor(scales), torch.float32)
    if tuple(values.shape) != (want[0], want[2], want[1]):
        raise ValueError(f"tensor {stored!r} holds {tuple(values.shape)} (out, in), expected "
                         f"{(want[0], want[2], want[1])} from the model config")
    return base, values.transpose(1, 2)


def experts_of(config: ModelConfig, raw: dict[str, torch.Tensor],
             mlp: str) -> dict[str, torch.Tensor]:
    """An MoE layer's router and stacked experts (LayerWeights' fields), popped from `raw`."""
    experts = range(config.num_experts)
    gate_up = torch.stack([torch.cat([raw.pop(f"{mlp}experts.{e}.{m}_proj.weight")
                                      for m in ("gate", "up")]) for e in experts])
    down = torch.stack([raw.pop(f"{mlp}experts.{e}.down_proj.weight") for e in experts])
    return dict(router=raw.pop(f"{mlp}gate.weight"), experts_gate_up=gate_up, experts_down=down)


def fused_experts_of(raw: dict[str, torch.Tensor], mlp: str) -> dict[str, torch.Tensor]:
    """gpt-oss's router and experts (LayerWeights' fields), its [E, in, out] weights transposed
    to [E, out, in] (gate and up left interleaved), popped from `raw`."""
    return dict(router=raw.pop(f"{mlp}router.weight"), router_bias=raw.pop(f"{mlp}router.bias"),
                experts_gate_up=raw.pop(f"{mlp}experts.gate_up_proj").transpose(1, 2).contiguous(),
                experts_gate_up_bias=raw.pop(f"{mlp}experts.gate_up_proj_bias"),
                experts_down=raw.pop(f"{mlp}experts.down_proj").transpose(1, 2).contiguous(),
                experts_down_bias=raw.pop(f"{mlp}experts.down_proj_bias"))
