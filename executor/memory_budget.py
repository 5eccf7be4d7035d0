"""What an executor holds in device memory, computed from its settings without allocating
anything: base weights, the paged KV cache, the adapter pool's tables (`loraplex budget` and each
runner's own `memory_budget()` use it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.peft.modules import BLOCK_OF
from executor.model_config import ModelConfig
from executor.shards import Shard


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


@dataclass(frozen=True)
class MemoryBudget:
    weights_bytes: int
    kv_cache_bytes: int
    adapter_pool_bytes: int

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
        kv = 2 * c.num_hidden_layers * num_kv_blocks * block_size * c.kv_size
        # The pool's tables (adapters' weights are in pages of the KV blocks): 8-byte offsets of
        # each chunk of each rank row of A and B^T, 4-byte ranks and scales (slot_pool.py).
        region = block_size * c.num_key_value_heads * c.head_dim
        chunk = 1 << (region.bit_length() - 1)
        shapes = c.projection_shapes()
        chunks = max(-(-n // chunk) for shape in shapes.values() for n in shape)
        modules = len(shapes)
        pool = (2 * num_slots * modules * max_rank * chunks * 8
                + 2 * c.num_hidden_layers * num_slots * modules * 4)
        return cls(weights * size, kv * size, pool)
