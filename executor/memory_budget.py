"""What an executor holds in device memory, computed from its settings without allocating
anything: base weights, the paged KV cache, the adapter pool's tables (`loraplex budget` and each
runner's own `memory_budget()` use it). A quantized base's projections count at their layouts'
bytes (executor/model/quant.py), and the budget says what that frees against the dense weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.peft.modules import BLOCK_OF
from executor.model.config import ModelConfig
from executor.model.quant_config import FP4, FP8, NF4, STATIC, Quantization, WeightScheme
from executor.tp.shards import Shard


def layer_parts(c: ModelConfig) -> tuple[int, int, int]:
    """Parameters of a layer's attention projections, of a dense MLP and of a mixture of experts
    (its experts and router): a layer has the first, and one of the other two."""
    attention = dense = experts = 0
    for module, (i, o) in c.projection_shapes().items():
        if BLOCK_OF.get(module) == "self_attn":
            attention += i * o
        elif module in BLOCK_OF:
            dense += i * o
        else:  # an expert's projection
            experts += i * o
    return attention, dense, experts + c.num_experts * c.hidden_size


# A layer's quantizable weights: (the projections joined into it, row-parallel), by layout
JOINED = ((("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), False),
          (("self_attn.o_proj",), True), (("mlp.gate_proj", "mlp.up_proj"), False),
          (("mlp.down_proj",), True))
FUSED = ((("self_attn.qkv_proj",), False), (("self_attn.o_proj",), True),
         (("mlp.gate_up_proj",), False), (("mlp.down_proj",), True))


def quantized_weight_bytes(q: Quantization, full: ModelConfig, local: ModelConfig) -> int:
    """What a (rank's part of a) quantized model's projections take in executor/model/quant.py's
    layouts, and what they would take dense (in elements), summed over the layers:
    (bytes, elements) of the quantized ones (the others are counted dense by the caller)."""
    total_bytes = total_elements = 0
    shapes, full_shapes = local.projection_shapes(), full.projection_shapes()
    for layer in range(local.num_hidden_layers):
        for modules, row_parallel in FUSED if local.fused_projections else JOINED:
            names = [m.split(".")[-1] for m in modules]
            if local.is_moe_layer(layer) and modules[0].startswith("mlp."):
                continue  # (experts: never quantized here)
            scheme = q.scheme_for(f"model.layers.{layer}.{modules[0]}")
            if scheme is None:
                continue
            in_f = shapes[names[0]][0]
            out_f = sum(shapes[n][1] for n in names)
            full_in = full_shapes[names[0]][0]
            total_bytes += scheme_bytes(scheme, out_f, in_f, full_in if row_parallel else in_f)
            total_elements += out_f * in_f
    return total_bytes, total_elements


def scheme_bytes(scheme: WeightScheme, out_f: int, in_f: int, full_in: int) -> int:
    """Bytes of one (joined) weight [out, in] of `scheme` as executor/model/quant.py holds it:
    codes, fp32 scales, int8 zeros, an act-order g_idx (whose row-parallel part keeps every group's
    scales: `full_in`), a codebook; FP8: fp8 values and fp32 scales per channel or block."""
    if scheme.kind == FP8:
        bn, bk = scheme.block
        scales = out_f if bn in (0, 1) and bk == 0 else -(-out_f // bn) * -(-in_f // bk)
        return out_f * in_f + 4 * scales + (4 if scheme.activations == STATIC else 0)
    groups = -(-(full_in if scheme.act_order else in_f) // scheme.group_size) \
        if scheme.group_size else 1
    size = out_f * in_f * scheme.bits // 8 + 4 * out_f * groups
    if not scheme.symmetric:
        size += out_f * groups
    if scheme.act_order:
        size += 4 * in_f
    if scheme.kind in (NF4, FP4):
        size += 4 * 16
    return size


@dataclass(frozen=True)
class MemoryBudget:
    weights_bytes: int
    kv_cache_bytes: int
    adapter_pool_bytes: int
    # What the weights would take with every quantized projection dense at the serving dtype
    # (0: not counted; not compared: a runner's own budget leaves it out); freed_bytes is the
    # difference, what quantization leaves for KV and adapters
    dense_weights_bytes: int = field(default=0, compare=False)

    @property
    def freed_bytes(self) -> int:
        return max(0, self.dense_weights_bytes - self.weights_bytes)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.adapter_pool_bytes

    @classmethod
    def estimate(cls, config: ModelConfig, *, num_kv_blocks: int, block_size: int, num_slots: int,
                 max_rank: int, dtype: torch.dtype = torch.float32,
                 tensor_parallel: int = 1) -> MemoryBudget:
        """What a runner with these settings will hold, computed without allocating anything
        (with `tensor_parallel` N: what each rank's holds, on each of the N GPUs)."""
        shard = Shard(config, 0, tensor_parallel)
        c, size = shard.config, torch.empty((), dtype=dtype).element_size()
        attention, dense_mlp, experts = layer_parts(c)
        per_layer = attention + (4 if c.sandwich_norms else 2) * c.hidden_size
        if c.attention_bias:
            per_layer += c.q_size + 2 * c.kv_size
        if c.qk_norm:
            per_layer += 2 * c.head_dim
        mlps = sum(experts if c.is_moe_layer(i) else dense_mlp
                   for i in range(c.num_hidden_layers))
        heads = 1 if c.tie_word_embeddings else 2
        weights = (c.num_hidden_layers * per_layer + mlps
                   + heads * shard.vocab_rows * c.hidden_size)
        weights += c.hidden_size
        dense = weights * size
        weights_bytes = dense
        if config.quantization is not None:
            quantized, elements = quantized_weight_bytes(config.quantization, config, c)
            weights_bytes += quantized - elements * size
        kv = 2 * c.num_hidden_layers * num_kv_blocks * block_size * c.kv_size
        # The pool's tables (adapters' weights are in pages of the KV blocks): 8-byte offsets of
        # each chunk of each rank row of A and B^T, 4-byte ranks and scales (lora/slot_pool.py).
        region = block_size * c.num_key_value_heads * c.head_dim
        chunk = 1 << (region.bit_length() - 1)
        shapes = c.projection_shapes()
        chunks = max(-(-n // chunk) for shape in shapes.values() for n in shape)
        modules = len(shapes)
        pool = (2 * num_slots * modules * max_rank * chunks * 8
                + 2 * c.num_hidden_layers * num_slots * modules * 4)
        return cls(weights_bytes, kv * size, pool, dense)
