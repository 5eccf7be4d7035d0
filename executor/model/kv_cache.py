"""The physical paged KV cache.

Block tables are owned by the scheduler; the executor mirrors each sequence's table (the ids the
scheduler appended so far) and only reads and writes the blocks it is told to. A token at
position p of a sequence lives in block `table[p // block_size]` at offset `p % block_size`; its
flat slot is `block_id * block_size + offset`.

Running example (block_size 4, table [7, 2]): positions 0..3 -> slots 28..31, 4..5 -> slots 8..9.

K and V are the two halves of one tensor [2, layers, blocks, block_size, kv heads, head_dim]: a
block's K (or V) in one layer is a region of block_size x kv heads x head_dim elements. Its
"layers" are a block's layer slots: the model's layers, but where sliding-window layers keep KV
of their own (common/kv_layout.py), the layers of one kind's column, each at its slot. A block the
scheduler gives an adapter holds that adapter's weights instead, in its regions of every layer
(common/adapter_pages.py, executor/lora/slot_pool.py): the cache only reads and writes the blocks of
sequences' tables, so adapters' pages and KV never meet.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"KV cache needs num_blocks > 0 and block_size > 0, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = num_layers
        self.region_elems = block_size * num_kv_heads * head_dim  # one layer's K (or V) of a block
        # [2, L, blocks, block_size, Hkv, D]: K, then V
        self.storage = torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                                   dtype=dtype, device=device)
        self.k = self.storage[0]  # [L, blocks, block_size, Hkv, D]
        self.v = self.storage[1]  # [L, blocks, block_size, Hkv, D]

    @property
    def flat(self) -> torch.Tensor:
        """The whole storage as one run of elements (what adapters' pages are addressed in)."""
        return self.storage.view(-1)

    def num_bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def check_block_ids(self, block_ids: tuple[int, ...] | list[int], seq_id: int) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"sequence {seq_id}: block id {bad[0]} out of range "
                             f"[0, {self.num_blocks})")

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """The flat slots of positions [start, end) of a sequence with this table, as plain ints
        (a step builds them for many short row groups: no small tensor each)."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] of this step's rows at flat `slots` [T] (distinct)."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v at flat `slots` of any shape [*S]: each [*S, Hkv, D]. (index_select copies whole
        [Hkv, D] rows; advanced indexing, element by element, was 6-8x slower on CPU.)"""
        flat = slots.flatten()
        k = self.k[layer].flatten(0, 1).index_select(0, flat)  # [S, Hkv, D]
        v = self.v[layer].flatten(0, 1).index_select(0, flat)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])
