"""What an executor holds in device memory, computed from its settings without allocating
anything: base weights, the paged KV cache, the adapter pool's tables (`loraplex budget` and each
runner's own `memory_budget()` use it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.model_config import ModelConfig
from executor.shards import Shard


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
        per_layer = sum(i * o for i, o in c.projection_shapes().values())
        per_layer += (4 if c.sandwich_norms else 2) * c.hidden_size
        if c.attention_bias:
            per_layer += c.q_size + 2 * c.kv_size
        if c.qk_norm:
            per_layer += 2 * c.head_dim
        heads = 1 if c.tie_word_embeddings else 2
        weights = c.num_hidden_layers * per_layer + heads * shard.vocab_rows * c.hidden_size
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
