"""A mixture-of-experts MLP over a step's rows, routed as transformers routes (Qwen3-MoE, Mixtral,
gpt-oss), with each row's adapter on the experts it is routed to.

For x [T, hidden] (ModelConfig's fields choose the variant):

    logits = x @ router^T (+ bias)       [T, E], the activations' dtype
    softmax_topk (Qwen3-MoE, Mixtral):
        probs = softmax(fp32 logits)     weights, experts = topk(probs, k)        [T, k]
        weights /= weights.sum(-1)       with norm_topk_prob (Mixtral always)
        weights -> x's dtype             unless routing_in_fp32 (Mixtral keeps fp32)
    topk_softmax (gpt-oss):
        values, experts = topk(logits, k)        weights = softmax(values), logits' dtype

The T * k (row, expert) pairs are sorted by expert, then adapter slot (stable: rows in order
within a run), so each expert's pairs, and each (expert, adapter)'s, are contiguous: the base runs
one grouped matmul per expert over its pairs (`grouped_matmul`: torch per expert on CPU, one
Triton launch over all of them on CUDA, kernels/moe_gemm.py), the LoRA backend one shrink and
expand per (expert, adapter) run over the pool's expert modules (common/peft/experts.py). Then

    h = act(gate) * up                  gate | up = pairs' x @ W_gate_up[e]^T (+ LoRA)
    y = h @ W_down[e]^T (+ LoRA)        out[row] += y * weight, in expert order per row

gpt-oss adds each expert's biases to gate_up and to y, and its gate and up are interleaved under a
clamped SwiGLU (layer_ops.clamped_swiglu).

Running example, T = 3 rows on slots [-1, 4, 4], k = 2, E = 4, experts [[2, 0], [1, 2], [0, 3]]:
pairs sorted (row, expert, slot) = (0, 0, -1), (2, 0, 4), (1, 1, 4), (0, 2, -1), (1, 2, 4),
(2, 3, 4): expert runs [0, 2) [2, 3) [3, 5) [5, 6); with an adapter, runs (expert 0, slot 4) =
[1, 2), (1, 4) = [2, 3), (2, 4) = [4, 5), (3, 4) = [5, 6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from executor.model.config import ModelConfig
from executor.model.layer_ops import activation, clamped_swiglu

if TYPE_CHECKING:
    from executor.model.weights import LayerWeights


@dataclass(frozen=True)
class Routing:
    """One MoE layer's routing of a step's rows, pairs sorted (see the module docstring)."""

    rows: torch.Tensor  # [P] long: each pair's row of x
    weights: torch.Tensor  # [P]: each pair's routing weight (fp32 or x's dtype)
    experts: torch.Tensor  # [P] long: each pair's expert
    slots: torch.Tensor  # [P] long, host: each pair's adapter slot (-1: none)
    expert_runs: tuple[tuple[int, int, int], ...]  # (start, end, expert) of each expert's pairs

    @classmethod
    def route(cls, config: ModelConfig, x: torch.Tensor, router: torch.Tensor,
              row_slots: torch.Tensor, bias: torch.Tensor | None = None) -> Routing:
        """x [T, hidden]; router [E, hidden] (bias [E] or None); row_slots [T] long (host)."""
        logits = F.linear(x, router, bias)  # [T, E]
        if config.routing == "topk_softmax":
            values, experts = torch.topk(logits, config.num_experts_per_tok, dim=-1)  # [T, k]
            weights = torch.softmax(values, dim=-1, dtype=values.dtype)
        else:
            probs = torch.softmax(logits.float(), dim=-1)
            weights, experts = torch.topk(probs, config.num_experts_per_tok, dim=-1)  # [T, k]
            if config.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if not config.routing_in_fp32:
                weights = weights.to(x.dtype)
        k = config.num_experts_per_tok
        flat_experts = experts.flatten().cpu()  # [T * k], row-major: row r's at r * k ...
        pair_slots = row_slots.repeat_interleave(k)
        span = int(pair_slots.max()) + 2 if pair_slots.numel() else 1
        order = torch.argsort(flat_experts * span + pair_slots + 1, stable=True)
        sorted_experts = flat_experts[order]
        ids, counts = torch.unique_consecutive(sorted_experts, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        runs = tuple((end - n, end, e) for e, n, end in zip(ids.tolist(), counts.tolist(), ends))
        device_order = order.to(x.device)
        return cls(rows=device_order // k, weights=weights.flatten()[device_order],
                   experts=sorted_experts.to(x.device), slots=pair_slots[order],
                   expert_runs=runs)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor,
                   runs: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
    """x [P, in] (pairs sorted by expert), w [E, out, in] -> [P, out]: each run's rows times its
    expert's weight transposed (the torch path: one matmul per expert)."""
    out = x.new_zeros(x.shape[0], w.shape[1])
    for start, end, e in runs:
        torch.matmul(x[start:end], w[e].T, out=out[start:end])
    return out


def grouped_matmul_for(device: torch.device):
    """The grouped matmul a device runs: the Triton kernel on CUDA, else grouped_matmul."""
    if device.type == "cuda":
        from kernels.moe_gemm import moe_gemm

        return moe_gemm
    return grouped_matmul


def moe_mlp(config: ModelConfig, layer: int, x: torch.Tensor, w: LayerWeights,
            row_slots: torch.Tensor, lora, lora_meta, matmul=grouped_matmul) -> torch.Tensor:
    """The MoE MLP's output [T, hidden] for x [T, hidden] (the pre-MLP norm's output) through
    layer weights `w` (its router and experts). `lora`, `lora_meta`: the step's LoRA backend and
    metadata (its expert hooks); `matmul`: the grouped matmul (grouped_matmul's signature)."""
    routing = Routing.route(config, x, w.router, row_slots, w.router_bias)
    experts_meta = lora.prepare_experts(routing.slots, routing.experts, routing.expert_runs)
    xs = x.index_select(0, routing.rows)  # [P, hidden]
    gate_up = matmul(xs, w.experts_gate_up, routing.expert_runs)  # [P, 2 * moe_intermediate]
    if w.experts_gate_up_bias is not None:
        gate_up += w.experts_gate_up_bias.index_select(0, routing.experts)
    lora.apply_experts(layer, "gate_up_proj", xs, gate_up, experts_meta)
    if config.swiglu_limit is not None:
        hidden = clamped_swiglu(gate_up, config.swiglu_limit, config.swiglu_alpha)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = activation(config.hidden_act)(gate) * up  # [P, moe_intermediate]
    y = matmul(hidden, w.experts_down, routing.expert_runs)  # [P, hidden]
    if w.experts_down_bias is not None:
        y += w.experts_down_bias.index_select(0, routing.experts)
    lora.apply_experts(layer, "down_proj", hidden, y, experts_meta)
    out = torch.zeros_like(x)
    out.index_add_(0, routing.rows, (y * routing.weights[:, None]).to(x.dtype))
    return out
