"""The scheduler's bookkeeping rules, checked after every step in tests and in the simulator's
tests. Each failure names the executor and what disagrees."""

from collections import Counter
from collections.abc import Iterable

from common.adapter_ref import AdapterRef
from scheduler.core import Scheduler
from scheduler.request import Request, Status
from scheduler.residency.slots import SlotState


def check_invariants(core: Scheduler, live: Iterable[Request] = ()) -> None:
    """Raise AssertionError when the scheduler's state is inconsistent.

    `live` are requests submitted and not yet finished: each must sit in exactly one queue or run
    on exactly one executor (no request lost).
    """
    queued_by_tenant: Counter[str] = Counter(r.tenant for r in core.orphans)
    placed: Counter[int] = Counter(id(r) for r in core.orphans)
    for ex in core.executors:
        where = ex.address
        pins: Counter[int] = Counter()
        for seq in ex.running.values():
            req = seq.request
            assert req.status is Status.RUNNING and req.executor is ex, \
                f"{where}: seq {seq.seq_id} misfiled"
            placed[id(req)] += 1
            if seq.slot is not None:
                assert seq.slot.adapter == req.adapter, \
                    f"{where}: seq {seq.seq_id} on a foreign slot"
                pins[seq.slot.index] += 1
        ex.steps.check(where, core.limits.max_batched_tokens)  # (its own bookkeeping)
        for seq in ex.unpin_later:  # left while steps with its rows were in flight
            assert ex.steps.is_in_flight(seq) and seq.seq_id not in ex.running, \
                f"{where}: seq {seq.seq_id} kept its slot pinned for no step"
            pins[seq.slot.index] += 1
        merge = ex.merge
        for slot in (merge.merged_slot, merge.unmerging):  # pinned while merged (merging.py)
            if slot is not None:
                pins[slot.index] += 1
        if merge.merged_slot is not None:
            adapter = merge.merged_slot.adapter
            assert all(s.request.adapter == adapter for s in ex.running.values()), \
                f"{where}: merged with {adapter}, runs another adapter"
        if merge.dedicated_to is not None:
            assert all(r.adapter == merge.dedicated_to for r in ex.queue), \
                f"{where}: dedicated to {merge.dedicated_to}, queues another adapter"
        held = Counter(s.adapter for s in ex.slots.slots
                       if s.adapter and s.state is not SlotState.CLEANING)
        assert all(n == 1 for n in held.values()), f"{where}: an adapter in two slots: {held}"
        pages: Counter[int] = Counter()
        for slot in ex.slots.slots:
            what = f"{where}: slot {slot.index}"
            assert slot.pins == pins[slot.index], f"{what} pins {slot.pins} != {pins[slot.index]}"
            assert slot.pins == 0 or slot.state is SlotState.READY, f"{what} pinned unready"
            assert (slot.state is SlotState.EMPTY) == (not slot.adapter), f"{what} state"
            if slot.adapter and slot.state is not SlotState.CLEANING:
                assert ex.slots.find(slot.adapter) is slot, f"{what}: index of {slot.adapter} stale"
                if ex.geometry is not None:
                    assert len(slot.pages) == ex.page_counts[slot.adapter], \
                        f"{what}: {slot.adapter} in {len(slot.pages)} pages, it needs " \
                        f"{ex.page_counts[slot.adapter]}"
            pages.update(slot.pages)
        assert all(n == 1 for n in pages.values()), f"{where}: a page in two slots"
        assert len(pages) == ex.blocks.num_pages, \
            f"{where}: {ex.blocks.num_pages} blocks are pages, slots hold {len(pages)}"
        assert set(ex.blocks.tables) == set(ex.running), f"{where}: blocks of unknown sequences"
        ex.blocks.check()  # every block free, cached or referenced, by as many as hold it
        in_tables = {b for t in ex.blocks.tables.values() for b in t}
        assert len(in_tables) == ex.blocks.num_allocated(), f"{where}: blocks leaked"
        holder: dict[int, Request] = {}
        for seq in ex.running.values():
            held = len(ex.blocks.tables[seq.seq_id]) * ex.blocks.block_size
            num_computed, _, _ = ex.steps.counters(seq)
            assert num_computed <= seq.capacity <= held, \
                f"{where}: seq {seq.seq_id} computes past its blocks, or believes it holds more"
            key = seq.request.cache_key
            for block in ex.blocks.tables[seq.seq_id]:
                other = holder.setdefault(block, seq.request)
                assert other is seq.request or key and other.cache_key == key, \
                    f"{where}: block {block} shared across cache keys"
        demand: Counter[AdapterRef | None] = Counter()
        for req in ex.queue:
            assert req.status is Status.QUEUED and req.executor is ex, \
                f"{where}: request {req.request_id} misfiled"
            queued_by_tenant[req.tenant] += 1
            placed[id(req)] += 1
            demand[req.adapter] += 1
        assert demand == Counter(ex.queue.demand), f"{where}: adapter demand counts drifted"
        assert len(ex.queue) == sum(demand.values()), f"{where}: queue length drifted"
    assert queued_by_tenant == Counter(core.fair.backlog), "tenant backlogs drifted"
    for req in live:
        if req.status is not Status.FINISHED:
            assert placed[id(req)] == 1, f"request {req.request_id} is in {placed[id(req)]} places"
