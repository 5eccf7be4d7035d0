"""The small per-family pieces of a decoder layer, each as HF transformers computes it (the
order of casts included, which decides bf16 results): the RMSNorm variants, the MLP activation,
soft-capping. ModelConfig's fields choose them (executor/model/config.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False, fp32_weight: bool = False) -> torch.Tensor:
    """x [..., n] normalised over its last dim in fp32, scaled by weight [n]:
    LLaMA: weight * (the normed x cast back to x's dtype);
    Gemma (unit_offset): (1 + weight) in fp32, times the fp32 normed x, then cast;
    gpt-oss (fp32_weight): weight in fp32 times the fp32 normed x, then cast."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    if fp32_weight:
        return (weight.float() * x32).to(x.dtype)
    return weight * x32.to(x.dtype)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's experts' activation of gate_up [..., 2 I], gate and up interleaved (gate's the
    even columns): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
    limit) -> [..., I]."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation of its gate (ModelConfig.hidden_act)."""
    if name in ("silu", "swish"):
        return F.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "gelu_new":  # (transformers' NewGELUActivation, op for op)
        return lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                                     * (x + 0.044715 * torch.pow(x, 3.0))))
    if name == "relu":
        return F.relu
    raise ValueError(f"activation {name!r} is not supported")


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's attention scores and final logits); x itself when None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap
