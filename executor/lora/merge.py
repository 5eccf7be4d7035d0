"""Merging one adapter into the base weights, and restoring them bit for bit.

A dedicated executor serving one hot adapter folds it into its weights: for every projection the
adapter targets, W' = W + scale * B @ A (the product and the sum in fp32, then rounded once to the
weights' dtype), and its rows then run the base model alone: no LoRA work at all. The error
against unmerged serving is that one rounding of W': none in practice at fp32 (the tests compare
greedy tokens and logits with HF PEFT), up to half an ulp of each weight at bf16 (about 0.2% of
its magnitude), where unmerged serving instead rounds the LoRA output once per token.

Unmerging never subtracts (that would not give W back at bf16): the tensors merging overwrote are
copied to host memory first and copied back. Only the fused weights the adapter targets are saved
(per layer: qkv, o, gate_up, down). An adapter of a fused layout (Phi-3's qkv_proj) adds its
B @ A over the whole fused weight, as it was trained. On a mixture of experts, an adapter's
experts merge the same way, each into its expert's weight (experts_gate_up[e], experts_down[e];
the layer's stacked weight saved whole once), as PEFT merges its target_parameters.

A quantized base (executor/model/quant.py) is not merged into: an adapter targeting one of its
quantized projections is refused before anything changes (check_mergeable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.peft.modules import parse_expert_module
from executor.lora.slot_pool import LoraSlotPool
from executor.model.quant import is_quantized
from executor.model.weights import ModelWeights

# Group -> the attribute of LayerWeights holding its fused base weight [out, in].
GROUP_WEIGHTS = {"qkv": "wqkv", "o": "wo", "gate_up": "w_gate_up", "down": "w_down"}


@dataclass
class Merged:
    """What a merge changed: slot merged, and the original tensors it overwrote, on the host."""

    slot: int
    originals: dict[tuple[int, str], torch.Tensor]  # (layer, weight attribute) -> its old value


def check_mergeable(weights: ModelWeights, pool: LoraSlotPool, slot: int) -> None:
    """ValueError naming the first quantized weight the adapter in `slot` targets: W + B @ A is
    dense, and rounding it back to the checkpoint's codes and scales would serve neither the
    adapter nor the base exactly (the adapter is served unmerged instead, at full precision)."""
    targets = pool.contents(slot).targets
    for layer_index, layer in enumerate(weights.layers):
        for group, g in pool.groups.items():
            w = getattr(layer, GROUP_WEIGHTS[group])
            if is_quantized(w) and any((layer_index, m) in targets for m in g.modules):
                raise ValueError(f"cannot merge the adapter in slot {slot}: layer "
                                 f"{layer_index}'s {group} is a quantized weight ({w.label}); "
                                 "folding B @ A into it would requantize the base, which is not "
                                 "exact: serve the adapter unmerged")


@torch.inference_mode()
def merge(weights: ModelWeights, pool: LoraSlotPool, slot: int) -> Merged:
    """Fold the adapter in `slot` into `weights`, in place; returns what restores them. Refused
    (ValueError, nothing changed) where it targets a quantized weight."""
    check_mergeable(weights, pool, slot)
    targets = pool.contents(slot).targets
    originals: dict[tuple[int, str], torch.Tensor] = {}
    for layer_index, layer in enumerate(weights.layers):
        for group, g in pool.groups.items():
            modules = g.modules  # (a fused layout's group is its one fused module)
            targeted = [m for m in modules if (layer_index, m) in targets]
            if not targeted:
                continue
            attr = GROUP_WEIGHTS[group]
            w = getattr(layer, attr)  # [sum(out_sizes), in]
            originals[(layer_index, attr)] = w.to("cpu", copy=True)
            merged = w.float()
            offset = 0
            for module in modules:
                out_f = pool.config.module_shape(module)[1]
                if module in targeted:
                    _, scale = targets[(layer_index, module)]
                    a, b = pool.rows(layer_index, slot, module)  # [r, in], [out, r]
                    merged[offset: offset + out_f] += scale * (b.float() @ a.float())
                offset += out_f
            w.copy_(merged.to(w.dtype))
    _merge_experts(weights, pool, slot, originals)
    return Merged(slot, originals)


def _merge_experts(weights: ModelWeights, pool: LoraSlotPool, slot: int,
                   originals: dict[tuple[int, str], torch.Tensor]) -> None:
    """Each expert module the adapter in `slot` targets, into its expert's weight."""
    for (layer_index, module), (_, scale) in pool.contents(slot).targets.items():
        expert = parse_expert_module(module)
        if expert is None:
            continue
        e, projection = expert
        attr = "experts_gate_up" if projection == "gate_up_proj" else "experts_down"
        stacked = getattr(weights.layers[layer_index], attr)  # [E, out, in]
        if (layer_index, attr) not in originals:
            originals[(layer_index, attr)] = stacked.to("cpu", copy=True)
        a, b = pool.rows(layer_index, slot, module)  # [r, in], [out, r]
        stacked[e].copy_((stacked[e].float() + scale * (b.float() @ a.float())).to(stacked.dtype))


@torch.inference_mode()
def unmerge(weights: ModelWeights, merged: Merged) -> None:
    """Put back every tensor `merge` overwrote, exactly as it was."""
    for (layer_index, attr), original in merged.originals.items():
        getattr(weights.layers[layer_index], attr).copy_(original)
