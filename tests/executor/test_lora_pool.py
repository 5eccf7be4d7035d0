"""LoraSlotPool keeps each adapter's weights in its pages (KV blocks, common/adapter_pages.py):
what a slot reads back is what was loaded, whatever was loaded, cleared or written around it
before; a load writes only its own pages and a clear none (they may hold KV by then); pages are
checked; and LoRA outputs over a reused pool are bit for bit a fresh pool's."""

import random

import pytest
import torch

from common.adapter_ref import AdapterRef
from common.peft.modules import LORA_MODULES
from common.sampling import SamplingParams
from executor.lora.slot_pool import EMPTY_SLOT, LoraModuleWeights, LoraSlotPool, LoraWeights
from executor.lora.torch_backend import TorchLoraBackend
from executor.lora.triton_backend import TritonLoraBackend
from executor.model.config import ModelConfig
from executor.runner import ModelRunner, Row
from tests.executor.lora_backends import backend_outputs, load
from tests.executor.lora_backends import make_pool as make_backend_pool
from tests.random_adapters import random_adapter

CONFIG = ModelConfig(hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=32)
NUM_SLOTS, MAX_RANK, NUM_BLOCKS = 3, 16, 400


class Pages:
    """Each slot's pages, chosen at random among free blocks on every load."""

    def __init__(self, pool: LoraSlotPool, seed: int = 0):
        self.pool, self.rng = pool, random.Random(seed)

    def load(self, slot: int, weights: LoraWeights) -> tuple[int, ...]:
        return load(self.pool, slot, weights, self.rng)


def make_pool(noise: bool = True) -> LoraSlotPool:
    return make_backend_pool(CONFIG, num_slots=NUM_SLOTS, max_rank=MAX_RANK,
                             num_blocks=NUM_BLOCKS, noise=noise)


def assert_holds(pool: LoraSlotPool, slot: int, weights: LoraWeights) -> None:
    for layer in range(CONFIG.num_hidden_layers):
        for module in LORA_MODULES:
            w, rows = weights.modules.get((layer, module)), pool.rows(layer, slot, module)
            assert (w is None) == (rows is None), (layer, module)
            if w is not None:
                assert torch.equal(rows[0], w.a) and torch.equal(rows[1], w.b), (layer, module)


def some_adapter(rng: random.Random, seed: int) -> LoraWeights:
    modules = tuple(rng.sample(LORA_MODULES, rng.randint(1, len(LORA_MODULES))))
    layers = rng.sample(range(CONFIG.num_hidden_layers), rng.randint(1, CONFIG.num_hidden_layers))
    return random_adapter(CONFIG, rng.randint(1, MAX_RANK), seed, modules=modules, layers=layers)


def page_bytes(pool: LoraSlotPool, slot: int) -> list[torch.Tensor]:
    """Copies of every region of a slot's pages (what its weights are in)."""
    storage = pool.kv.storage
    return [storage[:, :, b].clone() for b in pool.contents(slot).pages]


def test_each_slot_reads_back_what_was_loaded_through_reloads_and_clears():
    rng = random.Random(0)
    pool = make_pool()
    pages, occupants = Pages(pool), {}
    for step in range(60):
        slot = rng.randrange(NUM_SLOTS)
        if rng.random() < 0.25:
            pool.clear(slot)
            occupants.pop(slot, None)
            assert pool.contents(slot) == EMPTY_SLOT
        else:
            others = {s: page_bytes(pool, s) for s in occupants if s != slot}
            occupants[slot] = some_adapter(rng, seed=step)
            pages.load(slot, occupants[slot])
            for other, before in others.items():  # (nobody else's pages were written)
                assert all(torch.equal(a, b) for a, b in zip(before, page_bytes(pool, other)))
        for s, weights in occupants.items():
            assert_holds(pool, s, weights)


def test_an_adapter_takes_pages_by_its_ranks_and_a_clear_writes_nothing():
    pool = make_pool()
    small, large = (random_adapter(CONFIG, r, 1, same_rank=True) for r in (2, 16))
    assert pool.pages_for(large).num_pages >= 6 * pool.pages_for(small).num_pages
    Pages(pool).load(0, large)
    before = pool.kv.storage.clone()
    pool.clear(0)  # (its pages are the scheduler's again: they may hold KV already)
    assert torch.equal(pool.kv.storage, before) and pool.page_blocks() == set()


def test_pages_are_checked():
    pool = make_pool()
    weights = random_adapter(CONFIG, 4, 0)
    need = pool.pages_for(weights).num_pages
    with pytest.raises(ValueError, match=f"take {need} pages, {need - 1} given"):
        pool.load(0, weights, tuple(range(need - 1)))
    with pytest.raises(ValueError, match="is no KV block"):
        pool.load(0, weights, (NUM_BLOCKS, *range(need - 1)))
    pool.load(0, weights, tuple(range(need)))
    pool.load(0, weights, tuple(range(need, 2 * need)))  # (a slot may move its own)
    pool.mark_loaded(0)
    # Pages of slot 0 given to slot 1: the scheduler evicted slot 0's adapter (its unload may
    # come after this load), so slot 0 is emptied, not left reading slot 1's weights.
    pool.load(1, weights, tuple(range(need - 1, 2 * need - 1)))
    assert not pool.is_loaded(0) and not pool.contents(0).pages
    assert pool.page_blocks() == set(range(need - 1, 2 * need - 1))


def test_blocks_a_step_gives_to_kv_empty_the_slot_that_held_them_but_not_its_own_rows():
    """The scheduler evicts an adapter for KV and gives its pages to a sequence at once; its
    UnloadAdapter may come after that step. The step's KV takes the blocks and the slot is
    emptied (it was not failed); a sequence of the slot itself given its pages is refused."""
    runner = ModelRunner.random(CONFIG, num_kv_blocks=NUM_BLOCKS, block_size=4, num_slots=2,
                                max_rank=8)
    runner.load_adapter(0, random_adapter(CONFIG, 4, 0))
    runner.load_adapter(1, random_adapter(CONFIG, 4, 1))
    page = runner.pool.contents(0).pages[0]
    runner.add_sequence(7, [3, 4, 5], SamplingParams(), 1)
    with pytest.raises(ValueError, match="holds its own adapter's weights"):
        runner.step([Row(7, 3, (runner.pool.contents(1).pages[0],))])
    runner.add_sequence(8, [3, 4, 5], SamplingParams(), -1)
    runner.step([Row(8, 3, (page,))])
    assert not runner.pool.is_loaded(0) and page not in runner.pool.page_blocks()
    assert runner.pool.is_loaded(1)


def test_a_copy_that_fails_midway_leaves_the_slot_unloaded_and_its_neighbour_whole():
    pool = make_pool()
    pages = Pages(pool)
    neighbour = some_adapter(random.Random(1), seed=1)
    pages.load(1, neighbour)
    good = random_adapter(CONFIG, 12, 2).modules
    modules = {(0, "q_proj"): good[(0, "q_proj")],
               (1, "down_proj"): LoraModuleWeights(
                   a=good[(1, "down_proj")].a, scale=1.0,
                   b=torch.empty_like(good[(1, "down_proj")].b, device="meta"))}
    with pytest.raises((NotImplementedError, RuntimeError)):
        pages.load(0, LoraWeights(modules))
    assert not pool.is_loaded(0)
    assert_holds(pool, 1, neighbour)
    replacement = some_adapter(random.Random(3), seed=3)
    pages.load(0, replacement)
    assert_holds(pool, 0, replacement)


def test_the_pool_is_the_record_of_what_each_slot_holds():
    """Written is not loaded: a slot holds its adapter (and reads as loaded) only once marked,
    stops at mark_unloaded (its record kept), and is empty after a clear."""
    pool, ref = make_pool(), AdapterRef("a", 1)
    pages = Pages(pool)
    pages.load(0, random_adapter(CONFIG, 4, 0))
    assert not pool.is_loaded(0) and pool.adapters() == [None] * NUM_SLOTS
    pool.mark_loaded(0, ref)
    assert pool.holds(0, ref) and pool.adapters() == [ref, None, None]
    assert not pool.holds(0, AdapterRef("a", 2)) and not pool.holds(1, ref)
    pool.mark_unloaded(0)
    assert not pool.is_loaded(0) and not pool.holds(0, ref) and pool.contents(0).targets
    pool.mark_loaded(0, ref)
    pages.load(0, random_adapter(CONFIG, 2, 1))  # a load over it: written again, not loaded
    assert not pool.is_loaded(0) and pool.adapters() == [None] * NUM_SLOTS
    pool.clear(0)
    assert pool.contents(0) == EMPTY_SLOT
    with pytest.raises(ValueError, match="out of range"):
        pool.contents(NUM_SLOTS)


@pytest.mark.parametrize("backend", ["torch_exact", "torch_batched", "triton"])
def test_outputs_of_a_reused_pool_are_bit_identical(backend):
    rng = random.Random(2)
    reused, occupants = make_pool(), {}
    pages = Pages(reused)
    for step in range(12):  # every slot replaced several times, by larger and smaller adapters
        slot = step % NUM_SLOTS
        occupants[slot] = some_adapter(rng, seed=100 + step)
        pages.load(slot, occupants[slot])
    fresh = make_pool(noise=False)
    for slot, weights in occupants.items():
        Pages(fresh, seed=slot).load(slot, weights)

    def make(pool):
        if backend == "triton":
            return TritonLoraBackend(pool, target_ctas=4)
        return TorchLoraBackend(pool, exact=backend == "torch_exact")

    row_slots = torch.tensor([-1, 0, 0, 1, 2, 2, 2, -1, 1])
    outputs = backend_outputs(CONFIG, make(reused), make(fresh), row_slots, seed=3)
    for layer, group, _, got, want in outputs:
        assert torch.equal(got, want), (layer, group)
