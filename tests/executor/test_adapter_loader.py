"""The adapter loader's slot lock against threads that outlive their call: an UnloadAdapter whose
caller gives up while the slot is being cleared keeps the slot until the clear ends, so the next
load into it cannot be zeroed by a clear still running beside it."""

import asyncio
import threading
import time

import pytest
import torch

from common.adapter_ref import AdapterRef
from common.errors import FailedPrecondition
from executor.adapter_loader import AdapterLoader
from executor.lora.staged import Staged
from executor.model.config import ModelConfig
from executor.runner import ModelRunner
from tests.random_adapters import random_adapter

CONFIG = ModelConfig.named("tiny")


def stage(loader: AdapterLoader, runner: ModelRunner, adapter: AdapterRef,
          seed: int) -> tuple[int, ...]:
    """`adapter` as if staged on this host (no store needed); pages for it, as a scheduler
    would give them (blocks nothing uses)."""
    weights = random_adapter(CONFIG, 8, seed, same_rank=True)
    loader._staged.put(adapter, Staged(torch.empty(1, dtype=torch.uint8), 1, weights, 0.0,
                                       time.monotonic()))
    free, needed = runner.free_blocks(), runner.pool.pages_for(weights).num_pages
    return tuple(free[:needed])


def storeless_loader(num_kv_blocks: int) -> tuple[ModelRunner, AdapterLoader]:
    """A runner of two slots and a loader of no store (adapters come from `stage`)."""
    runner = ModelRunner.random(CONFIG, seed=0, num_kv_blocks=num_kv_blocks, block_size=16,
                                num_slots=2, max_rank=8)
    loader = AdapterLoader(runner, (), holder="test")
    loader.report_residency = lambda: asyncio.sleep(0, True)  # (no store to tell)
    return runner, loader


async def test_a_cancelled_unload_keeps_the_slot_until_its_clear_has_ended():
    runner, loader = storeless_loader(num_kv_blocks=16)
    x, y = AdapterRef("x", 1), AdapterRef("y", 1)
    await loader.load(x, 0, stage(loader, runner, x, 1))
    clear, started, may_end = loader._copier.clear, threading.Event(), threading.Event()

    def slow_clear(slot: int) -> None:  # (a memset behind a busy stream)
        started.set()
        may_end.wait(30)
        clear(slot)
    loader._copier.clear = slow_clear
    try:
        unload = asyncio.ensure_future(loader.unload(0))
        assert await asyncio.to_thread(started.wait, 30)
        unload.cancel()  # the caller's deadline passed
        await asyncio.sleep(0.05)
        assert loader._locks[0].locked(), "the slot was let go while its clear still ran"
    finally:
        may_end.set()
    await asyncio.gather(unload, return_exceptions=True)
    await loader.load(y, 0, stage(loader, runner, y, 2))
    held = runner.pool.contents(0)
    assert loader.slot_adapters[0] == y and held.is_loaded and held.targets
    assert int(runner.pool.rank_table[:, 0].sum()) > 0
    await loader.close()


async def test_a_load_into_other_pages_copies_the_adapter_there_and_unload_all_empties_slots():
    """A scheduler that lost track of the executor (a new step stream) loads an adapter the slot
    still holds, in other pages: it is copied there (the old pages may hold KV by now), not
    answered as resident."""
    runner, loader = storeless_loader(num_kv_blocks=64)
    x = AdapterRef("x", 1)
    first = stage(loader, runner, x, 1)
    assert not (await loader.load(x, 0, first)).was_resident
    weights = {(layer, module): runner.pool.rows(layer, 0, module)
               for layer, module in runner.pool.contents(0).targets}
    assert (await loader.load(x, 0, first)).was_resident  # the same pages: nothing to do
    others = tuple(b for b in runner.free_blocks() if b not in first)[:len(first)]
    stage(loader, runner, x, 1)
    runner.kv.flat.zero_()  # the old pages overwritten (by KV, say)
    result = await loader.load(x, 0, others)
    assert not result.was_resident and runner.pool.contents(0).pages == others
    for (layer, module), (a, b) in weights.items():
        got_a, got_b = runner.pool.rows(layer, 0, module)
        assert torch.equal(got_a, a) and torch.equal(got_b, b)
    assert weights
    await loader.unload_all()
    assert loader.slot_adapters == [None, None] and not runner.pool.page_blocks()
    await loader.close()


async def test_a_load_into_a_slot_merged_during_its_fetch_is_refused_and_the_merge_kept():
    """LoadAdapter checks the slot is not merged as it arrives; a merge can begin while the
    load fetches. The check that counts is the one under the merge lock, with the write: the load
    is refused (FAILED_PRECONDITION) and the merged adapter stays loaded, its weights intact."""
    runner, loader = storeless_loader(num_kv_blocks=64)
    x, y = AdapterRef("x", 1), AdapterRef("y", 1)
    await loader.load(x, 0, stage(loader, runner, x, 1))
    pages = stage(loader, runner, y, 2)  # y "fetched"; meanwhile a step merges slot 0
    runner.merge(0)
    merged = runner.weights.layers[0].wqkv.clone()
    with pytest.raises(FailedPrecondition, match="merged into the weights"):
        await loader.load(y, 0, pages)
    assert runner.merged_slot == 0 and loader.slot_adapters[0] == x
    assert runner.pool.holds(0, x) and torch.equal(runner.weights.layers[0].wqkv, merged)
    with pytest.raises(FailedPrecondition, match="merged into the weights"):
        await loader.unload(0)
    assert runner.pool.holds(0, x)
    runner.unmerge()
    await loader.load(y, 0, stage(loader, runner, y, 2))  # (the refused load used its staging)
    assert loader.slot_adapters[0] == y
    await loader.close()


async def test_loads_and_unloads_of_an_ended_step_stream_never_land():
    """A scheduler binds its loads and unloads to its step stream. Once that stream ends, the
    executor refuses them (the scheduler's next view gives out every block anew): a load still
    fetching when the stream ended, or sent after, leaves no adapter in pages the next view may
    give to KV or to another slot; one already copying is emptied by the stream's end."""
    runner, loader = storeless_loader(num_kv_blocks=64)
    x, y = AdapterRef("x", 1), AdapterRef("y", 1)
    loader.stream_id = "first"
    await loader.load(x, 0, stage(loader, runner, x, 1), stream_id="first")
    copy, copying, may_end = loader._copier.copy, threading.Event(), threading.Event()

    def slow_copy(slot, weights, pages):  # (a copy the stream's end overtakes)
        copying.set()
        may_end.wait(30)
        copy(slot, weights, pages)
    loader._copier.copy = slow_copy
    copying_load = asyncio.ensure_future(
        loader.load(y, 1, stage(loader, runner, y, 2), stream_id="first"))
    assert await asyncio.to_thread(copying.wait, 30)
    loader.stream_id = None  # the stream ends (ExecutorServicer.Step), then its slots empty
    emptied = asyncio.ensure_future(loader.unload_all())
    may_end.set()
    await copying_load
    await emptied
    assert loader.slot_adapters == [None, None] and not runner.pool.page_blocks()
    loader._copier.copy = copy
    late = stage(loader, runner, x, 1)
    with pytest.raises(FailedPrecondition, match="step stream this call belongs to has ended"):
        await loader.load(x, 0, late, stream_id="first")
    loader.stream_id = "second"
    with pytest.raises(FailedPrecondition, match="has ended"):
        await loader.load(x, 0, late, stream_id="first")
    assert not runner.pool.page_blocks()
    await loader.load(x, 0, stage(loader, runner, x, 1), stream_id="second")
    with pytest.raises(FailedPrecondition, match="has ended"):
        await loader.unload(0, stream_id="first")
    assert loader.slot_adapters[0] == x
    await loader.close()
