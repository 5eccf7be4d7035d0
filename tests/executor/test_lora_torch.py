"""The torch LoRA backend's batched path against its exact per-segment path."""

import threading

import pytest
import torch

from executor.lora.slot_copy import SlotCopier
from executor.lora.stack import StackedGroup
from executor.lora.torch_backend import TorchLoraBackend
from executor.model.config import ModelConfig
from tests.executor.lora_backends import backend_outputs, free_pages, load, make_pool
from tests.random_adapters import random_adapter

CONFIG = ModelConfig(hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=32)


@pytest.fixture
def pool():
    pool = make_pool(CONFIG, num_slots=5, max_rank=16)  # (its storage noise around the pages)
    load(pool, 0, random_adapter(CONFIG, 16, 0))
    load(pool, 1, random_adapter(CONFIG, 1, 1, modules=("q_proj", "down_proj")))
    load(pool, 2, random_adapter(CONFIG, 16, 2))
    # Slot 2 again, over a larger adapter:
    load(pool, 2, random_adapter(CONFIG, 3, 22, modules=("v_proj", "gate_proj", "o_proj")))
    load(pool, 3, random_adapter(CONFIG, 8, 3, layers=[1]))
    load(pool, 4, random_adapter(CONFIG, 5, 4))
    return pool


@pytest.mark.parametrize("row_slots", [
    [-1, 0, 0, 0, 1, -1, 3, 3, 2, 4, 4],  # decode-shaped: every segment short
    [0, 1, 2, 3, 4],  # a row per adapter, every row: read and written in place
    [0] * 12 + [1, -1, 2, 2, 3] + [4] * 9 + [-1, 2],  # prefill-long segments beside short ones
    [0] * 30,  # one segment of a prefill chunk: in place too
    # prefill chunks of several length classes, one too long to batch (slot 4), decode rows
    [0] * 10 + [1] * 16 + [2] * 17 + [3] * 30 + [4] * 40 + [-1] * 3 + [2, 3, 0],
    [0] * 9 + [1] * 10 + [2] * 12 + [3] * 20 + [1] * 21 + [0] * 32,  # several per class
    [-1, -1, -1],  # no adapter at all
])
def test_batched_segments_match_per_segment_matmuls(pool, row_slots):
    row_slots = torch.tensor(row_slots)
    fast, exact = TorchLoraBackend(pool), TorchLoraBackend(pool, exact=True)
    meta_fast, meta_exact = fast.prepare(row_slots), exact.prepare(row_slots)
    assert meta_exact.batches == ()
    assert not any(end - start <= 32 for start, end, _ in meta_fast.alone)
    assert bool(meta_fast.batches) == bool((row_slots >= 0).any())
    for batch in meta_fast.batches:  # padding at most doubles a segment past decode length
        width = len(batch.rows) // batch.size
        positions = torch.arange(len(batch.rows)) if batch.valid is None else batch.valid
        lens = torch.bincount(positions // width)
        assert width <= max(8, 2 * int(lens[lens > 0].min()) - 1)
    for _, _, base, got, want in backend_outputs(CONFIG, fast, exact, row_slots, seed=5):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        untouched = row_slots < 0
        assert torch.equal(got[untouched], base[untouched])  # rows without adapter cost nothing


def check_against_exact(backend, pool, row_slots, meta=None):
    exact = TorchLoraBackend(pool, exact=True)
    for _, _, _, got, want in backend_outputs(CONFIG, backend, exact, torch.tensor(row_slots),
                                              seed=9, first_meta=meta):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_many_decode_rows_of_one_adapter_keep_their_stack(pool, monkeypatch):
    """16 decode rows of one adapter batch like a prefill chunk of 16 rows (their length
    class), yet the tier has no kept stack: theirs is kept, and the steps after it copy
    nothing (each step built and copied one before)."""
    copied = []
    original = StackedGroup.copy
    monkeypatch.setattr(StackedGroup, "copy", lambda self, layer, g, stack, positions: (
        copied.extend(positions), original(self, layer, g, stack, positions)))
    fast = TorchLoraBackend(pool)
    rows = [0] * 16
    first = fast.prepare(torch.tensor(rows)).batches[0].stack
    check_against_exact(fast, pool, rows)
    assert copied
    copied.clear()
    for _ in range(2):
        assert fast.prepare(torch.tensor(rows)).batches[0].stack is first
        check_against_exact(fast, pool, rows)
    assert copied == []


def test_decode_steps_keep_one_stack_and_copy_only_what_changed(pool, monkeypatch):
    """Decode steps over the same adapters read one stacked copy of them, not a copy per step. A
    step over half of them or more reads the whole stack; a new adapter is appended to it and a
    slot written since (another adapter loaded into it) is copied again, each alone; a step over
    few of them gathers their positions of it. Every step's output equals the exact path's."""
    copied = []
    original = StackedGroup.copy
    monkeypatch.setattr(StackedGroup, "copy", lambda self, layer, g, stack, positions: (
        copied.extend(positions), original(self, layer, g, stack, positions)))
    fast = TorchLoraBackend(pool)
    four = [0, 1, 2, 3]
    first = fast.prepare(torch.tensor(four)).batches[0].stack
    check_against_exact(fast, pool, four)
    copied.clear()
    every = [0, 1, 2, 3, 4]  # slot 4 is new: appended, and only it is copied
    assert fast.prepare(torch.tensor(every)).batches[0].stack is first
    assert first.slots == every and set(copied) == {4}
    check_against_exact(fast, pool, every)
    copied.clear()
    assert fast.prepare(torch.tensor([0, 0, 1, 2, 3, 4])).batches[0].stack is first
    most = [0, 2, 3, 4]  # 4 of the stack's 5: its rows for slot 1 are all padding
    assert fast.prepare(torch.tensor(most)).batches[0].stack is first
    check_against_exact(fast, pool, most)
    # 3 of 5, e.g. the decode rows of a step whose other adapters run prefill chunks: reading
    # the whole stack costs less than copying a new one (and then the old one again)
    assert fast.prepare(torch.tensor([0, 2, 4])).batches[0].stack is first
    prefill_step = [0] * 12 + [1, 2, 3, 4]  # the chunk's batch (slot 0) gathers its position
    meta = fast.prepare(torch.tensor(prefill_step))
    assert [b.stack is first for b in meta.batches] == [True, True]
    assert [b.positions is None for b in meta.batches] == [True, False]  # (decode first)
    check_against_exact(fast, pool, prefill_step)
    assert fast.prepare(torch.tensor(every)).batches[0].stack is first  # still kept
    copied.clear()

    load(pool, 1, random_adapter(CONFIG, 7, 77))  # slot 1 rewritten: copied again, alone
    assert fast.prepare(torch.tensor(every)).batches[0].stack is first
    assert set(copied) == {1}
    check_against_exact(fast, pool, every)  # the new weights of slot 1, not the old copy
    copied.clear()
    load(pool, 0, random_adapter(CONFIG, 16, 70))
    load(pool, 3, random_adapter(CONFIG, 8, 73))  # two apart: copied where they sit
    assert fast.prepare(torch.tensor(every)).batches[0].stack is first
    assert set(copied) == {0, 3}
    check_against_exact(fast, pool, every)

    copied.clear()
    few = [4, 3]  # gathered from the kept stack, in the step's order; nothing copied
    batch = fast.prepare(torch.tensor(few)).batches[0]
    assert batch.stack is first and batch.positions.tolist() == [4, 3] and copied == []
    check_against_exact(fast, pool, few)
    split = [2, 2, 0, 2]  # slot 2 in two runs: a position of the stack for each
    check_against_exact(fast, pool, split)
    runs = [0, 1, 0, 1, 0, 1, 2, 3, 4]  # more segments than the pool has slots
    check_against_exact(fast, pool, runs)


def test_a_step_of_prefill_chunks_alone_leaves_the_decode_stack_kept(pool, monkeypatch):
    """A new wave's first step is prefill chunks only (no decode rows): their batches gather
    their adapters' positions of the stack the decode steps keep, and the decode steps after it
    read that stack again: nothing is copied (the chunks' batches used to copy their adapters
    from the pages into stacks of their own, the largest replacing the kept one, and the next
    decode step copied every adapter again)."""
    copied = []
    original = StackedGroup.copy
    monkeypatch.setattr(StackedGroup, "copy", lambda self, layer, g, stack, positions: (
        copied.extend(positions), original(self, layer, g, stack, positions)))
    fast = TorchLoraBackend(pool)
    every = [0, 1, 2, 3, 4]
    kept = fast.prepare(torch.tensor(every)).batches[0].stack
    check_against_exact(fast, pool, every)
    chunks = [0] * 12 + [1] * 12 + [2] * 20  # two length classes, no decode row
    copied.clear()
    meta = fast.prepare(torch.tensor(chunks))
    assert len(meta.batches) == 2 and all(b.stack is kept for b in meta.batches)
    check_against_exact(fast, pool, chunks, meta)
    assert fast.prepare(torch.tensor(every)).batches[0].stack is kept
    check_against_exact(fast, pool, every)
    assert copied == []


class HeldLoad:
    """A load into `slot` on a worker thread (as the AdapterLoader's), held before each module it
    writes: `advance()` lets it write one more."""

    def __init__(self, pool, slot, weights):
        self.arrived, self.proceed = threading.Semaphore(0), threading.Semaphore(0)
        layer_base = pool.layer_base

        def held_layer_base(layer):  # (the load calls it before each module's rows and ranks)
            if threading.current_thread() is self.thread:
                self.arrived.release()
                self.proceed.acquire()
            return layer_base(layer)

        pool.layer_base = held_layer_base
        pages = free_pages(pool, slot, weights)
        self.thread = threading.Thread(target=SlotCopier(pool).copy, args=(slot, weights, pages),
                                       daemon=True)
        self.thread.start()
        assert self.arrived.acquire(timeout=10)  # forgotten, about to write its first module

    def advance(self) -> None:
        self.proceed.release()
        while self.thread.is_alive() and not self.arrived.acquire(timeout=0.01):
            pass

    def finish(self) -> None:
        while self.thread.is_alive():
            self.advance()
        self.thread.join()


@pytest.mark.parametrize("load_begins", ["before the step", "between prepare and forward"])
def test_a_step_reads_no_slot_outside_it_while_a_load_writes_one(monkeypatch, load_begins):
    """The kept stack covers slots a step does not run; a load may be writing one of them on the
    loader's thread (its ranks, offsets and rows change under a reader). The step must not read
    that slot: here the load writes one more module whenever the step reads the slot's rows (the
    interleaving that crashed the executor with a rank-64 copy beside a rank-16 stack), and the
    groups the step builds anew in its forward (slot 0 outgrew them) cover the slot too. Once
    loaded, a step over it reads the new adapter."""
    pool = make_pool(CONFIG, num_slots=4, max_rank=64, num_blocks=1600)
    for slot in range(4):
        load(pool, slot, random_adapter(CONFIG, 4, 40 + slot, same_rank=True))
    fast = TorchLoraBackend(pool)
    every = [0, 1, 2, 3]
    stack = fast.prepare(torch.tensor(every)).batches[0].stack
    check_against_exact(fast, pool, every)
    load(pool, 0, random_adapter(CONFIG, 12, 50, same_rank=True))  # slot 0's groups: rebuilt
    step = [0, 1, 2]  # 3 of the stack's 4: it reads the kept stack, position 3 as padding
    meta = None if load_begins == "before the step" else fast.prepare(torch.tensor(step))
    held = HeldLoad(pool, 3, random_adapter(CONFIG, 16, 53, same_rank=True))
    rows = pool.rows
    read = []

    def rows_while_loading(layer, slot, module):
        if slot == 3:
            read.append((layer, module))
            held.advance()
        return rows(layer, slot, module)

    monkeypatch.setattr(pool, "rows", rows_while_loading)
    try:
        meta = meta or fast.prepare(torch.tensor(step))
        assert meta.batches[0].stack is stack
        check_against_exact(fast, pool, step, meta)
        assert read == []
    finally:
        held.finish()
    pool.mark_loaded(3)
    assert fast.prepare(torch.tensor(every)).batches[0].stack is stack
    check_against_exact(fast, pool, every)  # slot 3's new rank-16 rows, copied where it sits
    assert stack.group(0, "qkv", pool.device, pool.dtype).rank == 16


def test_a_stack_group_is_rebuilt_when_a_slot_needs_a_larger_rank(pool):
    fast = TorchLoraBackend(pool)
    low = [3, 4]  # ranks up to 8 and 5
    stack = fast.prepare(torch.tensor(low)).batches[0].stack
    check_against_exact(fast, pool, low)
    ranks = {key: group.rank for key, group in stack.groups.items() if group is not None}
    load(pool, 4, random_adapter(CONFIG, 16, 44))
    assert fast.prepare(torch.tensor(low)).batches[0].stack is stack
    check_against_exact(fast, pool, low)
    assert all(stack.groups[key].rank > rank for key, rank in ranks.items())


def test_adapters_of_one_rank_need_no_mask_and_match_the_exact_path():
    """The usual case: every adapter of a batch has the same rank on every projection, so no
    rank is masked off; decode rows and prefill chunks still equal the exact path's."""
    pool = make_pool(CONFIG, num_slots=4, max_rank=16)
    for slot in range(4):
        load(pool, slot, random_adapter(CONFIG, 8, 30 + slot, same_rank=True))
    fast = TorchLoraBackend(pool)
    decode = [0, 1, 2, 3]
    meta = fast.prepare(torch.tensor(decode))
    stacked = meta.batches[0].stack.group(0, "qkv", pool.device, torch.float32)
    assert stacked.drop is None
    check_against_exact(fast, pool, decode)
    check_against_exact(fast, pool, [0] * 11 + [1] * 12 + [2, 3])


def test_adapters_of_far_apart_ranks_are_batched_at_their_own_ranks():
    """A decode step over adapters of ranks 8, 16, 40 and 64: the rank-8 and rank-16 rows run at
    rank 16, the others at 64, not all at 64 (and each tier keeps a stack of its own)."""
    pool = make_pool(CONFIG, num_slots=4, max_rank=64, num_blocks=1200)
    for slot, rank in enumerate((8, 64, 16, 40)):
        load(pool, slot, random_adapter(CONFIG, rank, slot, same_rank=True))
    fast = TorchLoraBackend(pool)
    row_slots = [0, 1, 2, 3, 0]
    meta = fast.prepare(torch.tensor(row_slots))
    ranks = {tuple(sorted(set(b.stack.slots))):
             b.stack.group(0, "qkv", pool.device, pool.dtype).rank for b in meta.batches}
    assert ranks == {(0, 2): 16, (1, 3): 64}
    check_against_exact(fast, pool, row_slots)
    again = fast.prepare(torch.tensor(row_slots))
    assert [b.stack for b in again.batches] == [b.stack for b in meta.batches]  # kept, per tier


def test_a_slot_reloaded_at_another_tier_goes_dormant_in_its_old_tiers_stack():
    """32 rank-8 adapters share the rank-16 tier's kept stack; slot 31 is reloaded with a
    rank-64 adapter and runs in the rank-64 tier's batch: the rank-16 stack must not copy it at
    rank 64 (every group of it rebuilt at 4x its size); its position goes dormant there."""
    pool = make_pool(CONFIG, num_slots=33, max_rank=64, num_blocks=4000)
    for slot in range(32):
        load(pool, slot, random_adapter(CONFIG, 8, slot, same_rank=True))
    fast = TorchLoraBackend(pool)
    step = list(range(32))
    stack = fast.prepare(torch.tensor(step)).batches[0].stack
    check_against_exact(fast, pool, step)
    assert stack.group(0, "qkv", pool.device, pool.dtype).rank == 8
    load(pool, 31, random_adapter(CONFIG, 64, 99, same_rank=True))
    meta = fast.prepare(torch.tensor(step))
    assert meta.batches[0].stack is stack
    check_against_exact(fast, pool, step, meta)
    assert stack.group(0, "qkv", pool.device, pool.dtype).rank == 8


def test_a_long_segment_reads_its_rows_from_the_pages_once_until_the_slot_is_rewritten(
        pool, monkeypatch):
    """A decode step over one adapter's 40 rows runs its segment on its own: its A and B are
    gathered from the pages once and kept (not every step), gathered again when the pool
    rewrites the slot, and the outputs equal the exact path's throughout."""
    gathered = []
    rows = pool.rows
    monkeypatch.setattr(pool, "rows", lambda layer, slot, module: (
        gathered.append((layer, slot, module)), rows(layer, slot, module))[1])
    fast = TorchLoraBackend(pool)
    step = [4] * 40
    assert fast.prepare(torch.tensor(step)).alone
    for _ in range(2):
        for layer, group, *_ in backend_outputs(CONFIG, fast, fast, torch.tensor(step), seed=1):
            pass
    once = len(gathered)
    assert once == len({(layer, module) for layer, _, module in gathered})
    load(pool, 4, random_adapter(CONFIG, 7, 40))
    check_against_exact(fast, pool, step)
    assert len(gathered) > once
