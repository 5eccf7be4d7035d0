"""Two LoRA backends' outputs side by side, on the same random inputs; slot pools over a KV
cache of noise, and a stand-in for the scheduler's choice of their pages."""

import random

import torch

from executor.lora.slot_pool import LoraSlotPool, LoraWeights, lora_groups
from executor.model.kv_cache import PagedKVCache


def make_pool(config, *, num_slots: int, max_rank: int, num_blocks: int = 400,
              block_size: int = 4, noise: bool = True) -> LoraSlotPool:
    """A pool over a fresh KV cache, its storage random unless not `noise` (KV and old weights:
    a row read from anywhere but its place shows)."""
    kv = PagedKVCache(num_layers=config.num_hidden_layers, num_blocks=num_blocks,
                      block_size=block_size, num_kv_heads=config.num_key_value_heads,
                      head_dim=config.head_dim)
    if noise:
        kv.storage.normal_(generator=torch.Generator().manual_seed(9))
    return LoraSlotPool(config, num_slots=num_slots, max_rank=max_rank, kv=kv)


def free_pages(pool: LoraSlotPool, slot: int, weights: LoraWeights,
               rng: random.Random | None = None) -> tuple[int, ...]:
    """Pages for `weights` in `slot`, among blocks no other slot's adapter is in (at random
    with `rng`, else the lowest)."""
    others = pool.page_blocks() - set(pool.contents(slot).pages)
    free = [b for b in range(pool.kv.num_blocks) if b not in others]
    needed = pool.pages_for(weights).num_pages
    return tuple(rng.sample(free, needed) if rng else free[:needed])


def load(pool: LoraSlotPool, slot: int, weights: LoraWeights,
         rng: random.Random | None = None) -> tuple[int, ...]:
    """Load `weights` into `slot`, in free pages; the pages."""
    pages = free_pages(pool, slot, weights, rng)
    pool.load(slot, weights, pages)
    return pages


def backend_outputs(config, first, second, row_slots, seed, first_meta=None):
    """(layer, group, base, first's output, second's output) of two LoRA backends' apply on the
    same random inputs, for every layer and group (`first_meta`: first's, prepared already)."""
    first_meta = first.prepare(row_slots) if first_meta is None else first_meta
    second_meta = second.prepare(row_slots)
    g = torch.Generator().manual_seed(seed)
    for layer in range(config.num_hidden_layers):
        for group, modules in lora_groups(config).items():
            in_f = config.module_shape(modules[0])[0]
            width = sum(config.module_shape(m)[1] for m in modules)
            x = torch.randn(len(row_slots), in_f, generator=g)
            base = torch.randn(len(row_slots), width, generator=g)
            got, want = base.clone(), base.clone()
            first.apply(layer, group, x, got, first_meta)
            second.apply(layer, group, x, want, second_meta)
            yield layer, group, base, got, want
