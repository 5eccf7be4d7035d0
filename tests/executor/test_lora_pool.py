"""LoraSlotPool.load/clear zero only what a slot's previous adapter wrote, yet the pool is always
bit for bit what a fresh pool holds after the same loads, and so are the LoRA outputs."""

import random

import pytest
import torch

from common.adapter_ref import AdapterRef
from common.peft.modules import LORA_MODULES
from executor.lora_torch import TorchLoraBackend
from executor.lora_triton import TritonLoraBackend
from executor.model_config import ModelConfig
from executor.slot_pool import (
    EMPTY_SLOT,
    LORA_GROUPS,
    LoraModuleWeights,
    LoraSlotPool,
    LoraWeights,
)
from tests.executor.lora_backends import backend_outputs
from tests.random_adapters import random_adapter

CONFIG = ModelConfig(hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=32)
NUM_SLOTS, MAX_RANK = 3, 16


def fresh_pool(occupants: dict[int, LoraWeights]) -> LoraSlotPool:
    pool = LoraSlotPool(CONFIG, num_slots=NUM_SLOTS, max_rank=MAX_RANK)
    for slot, weights in occupants.items():
        pool.load(slot, weights)
    return pool


def assert_same_pool(got: LoraSlotPool, want: LoraSlotPool) -> None:
    for name in LORA_GROUPS:
        assert torch.equal(got.groups[name].a, want.groups[name].a), name
        assert torch.equal(got.groups[name].bt, want.groups[name].bt), name
    for module in LORA_MODULES:
        assert torch.equal(got.scale[module], want.scale[module]), module
    assert torch.equal(got.rank_table, want.rank_table)
    assert torch.equal(got.scale_table, want.scale_table)
    assert ([got.contents(s).targets for s in range(NUM_SLOTS)]
            == [want.contents(s).targets for s in range(NUM_SLOTS)])


def some_adapter(rng: random.Random, seed: int) -> LoraWeights:
    modules = tuple(rng.sample(LORA_MODULES, rng.randint(1, len(LORA_MODULES))))
    layers = rng.sample(range(CONFIG.num_hidden_layers), rng.randint(1, CONFIG.num_hidden_layers))
    return random_adapter(CONFIG, rng.randint(1, MAX_RANK), seed, modules=modules, layers=layers)


def test_reused_slots_hold_what_a_fresh_pool_holds():
    """Loads over larger and smaller adapters, other modules and layers, and clears, in random
    order: after every step the pool equals a fresh one loaded with the current occupants."""
    rng = random.Random(0)
    pool, occupants = fresh_pool({}), {}
    for step in range(60):
        slot = rng.randrange(NUM_SLOTS)
        if rng.random() < 0.25:
            pool.clear(slot)
            occupants.pop(slot, None)
        else:
            occupants[slot] = some_adapter(rng, seed=step)
            pool.load(slot, occupants[slot])
        assert_same_pool(pool, fresh_pool(occupants))


def test_a_small_adapter_zeroes_only_its_ranks():
    """Clearing a rank-2 adapter touches ranks 0-1 only: a marker planted above them survives
    (nothing but a load writes there, so in use that region is always zero)."""
    pool = fresh_pool({0: random_adapter(CONFIG, 2, 1, modules=("q_proj",))})
    g = pool.groups["qkv"]
    g.a[:, 0, :, 5] = 7.0
    pool.clear(0)
    assert torch.count_nonzero(g.a[:, 0, :, :5]) == 0 and torch.count_nonzero(g.bt[:, 0]) == 0
    assert bool((g.a[:, 0, :, 5] == 7.0).all())


def test_a_copy_that_fails_midway_is_cleared_in_full():
    neighbour = some_adapter(random.Random(1), seed=1)
    pool = fresh_pool({1: neighbour})
    good = random_adapter(CONFIG, 12, 2).modules
    # The last module is alone in its group (down): only the record of it can clear it. Shapes
    # fit, so the load starts copying; its B, a meta tensor, then fails to copy (after its A).
    modules = {(0, "q_proj"): good[(0, "q_proj")],
               (1, "down_proj"): LoraModuleWeights(
                   a=good[(1, "down_proj")].a, scale=1.0,
                   b=torch.empty_like(good[(1, "down_proj")].b, device="meta"))}
    with pytest.raises((NotImplementedError, RuntimeError)):
        pool.load(0, LoraWeights(modules))
    assert torch.count_nonzero(pool.groups["down"].a[1, 0]) > 0  # the copy got that far
    pool.clear(0)
    assert_same_pool(pool, fresh_pool({1: neighbour}))


def test_the_pool_is_the_record_of_what_each_slot_holds():
    """Written is not loaded: a slot holds its adapter (and reads as loaded) only once marked,
    stops at mark_unloaded (its record kept, for the zeroing), and is empty after a clear."""
    pool, ref = fresh_pool({}), AdapterRef("a", 1)
    pool.load(0, random_adapter(CONFIG, 4, 0))
    assert not pool.is_loaded(0) and pool.adapters() == [None] * NUM_SLOTS
    pool.mark_loaded(0, ref)
    assert pool.holds(0, ref) and pool.adapters() == [ref, None, None]
    assert not pool.holds(0, AdapterRef("a", 2)) and not pool.holds(1, ref)
    pool.mark_unloaded(0)
    assert not pool.is_loaded(0) and not pool.holds(0, ref) and pool.contents(0).targets
    pool.mark_loaded(0, ref)
    pool.load(0, random_adapter(CONFIG, 2, 1))  # a load over it: written again, not loaded
    assert not pool.is_loaded(0) and pool.adapters() == [None] * NUM_SLOTS
    pool.clear(0)
    assert pool.contents(0) == EMPTY_SLOT
    with pytest.raises(ValueError, match="out of range"):
        pool.contents(NUM_SLOTS)


@pytest.mark.parametrize("backend", ["torch_exact", "torch_batched", "triton"])
def test_outputs_of_a_reused_pool_are_bit_identical(backend):
    rng = random.Random(2)
    reused, occupants = fresh_pool({}), {}
    for step in range(12):  # every slot replaced several times, by larger and smaller adapters
        slot = step % NUM_SLOTS
        occupants[slot] = some_adapter(rng, seed=100 + step)
        reused.load(slot, occupants[slot])
    fresh = fresh_pool(occupants)

    def make(pool):
        if backend == "triton":
            return TritonLoraBackend(pool, target_ctas=4)
        return TorchLoraBackend(pool, exact=backend == "torch_exact")

    row_slots = torch.tensor([-1, 0, 0, 1, 2, 2, 2, -1, 1])
    outputs = backend_outputs(CONFIG, make(reused), make(fresh), row_slots, seed=3)
    for layer, group, _, got, want in outputs:
        assert torch.equal(got, want), (layer, group)
