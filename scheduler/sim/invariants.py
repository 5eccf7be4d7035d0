"""The scheduler's bookkeeping rules, checked after every step in tests and in the simulator's
tests. Each failure names the executor and what disagrees. What only one manager can see it
checks itself (`check`: the step builders, an executor's residency, the block manager); this
checks what spans them."""

from collections import Counter
from collections.abc import Iterable

from common.adapter_ref import AdapterRef
from scheduler.core import Scheduler
from scheduler.request import Request, Status


def check_invariants(core: Scheduler, live: Iterable[Request] = ()) -> None:
    """Raise AssertionError when the scheduler's state is inconsistent.

    `live` are requests submitted and not yet finished: each must sit in exactly one queue or run
    on exactly one executor (no request lost).
    """
    orphans = core.placement.orphans
    queued_by_tenant: Counter[str] = Counter(r.ask.tenant for r in orphans)
    placed: Counter[int] = Counter(id(r) for r in orphans)
    for ex in core.executors:
        where, steps = ex.address, core.steps_of(ex)
        part, running = core.residency.of(ex), steps.running
        pins: Counter[int] = Counter()
        for seq in running.values():
            req = seq.request
            assert req.status is Status.RUNNING and req.executor is ex, \
                f"{where}: seq {seq.seq_id} misfiled"
            placed[id(req)] += 1
            if seq.slot_index >= 0:
                assert part.adapter_in(seq.slot_index) == req.ask.adapter, \
                    f"{where}: seq {seq.seq_id} on a foreign slot"
                pins[seq.slot_index] += 1
        steps.check(where, core.limits.max_batched_tokens)  # (its own bookkeeping)
        merge = core.merges.state(ex)
        for slot in (merge.merged_slot, merge.unmerging):  # pinned while merged (merging.py)
            if slot is not None:
                pins[slot] += 1
        if merge.merged_slot is not None:
            adapter = part.adapter_in(merge.merged_slot)
            assert steps.runs_only(adapter), f"{where}: merged with {adapter}, runs another adapter"
        queue = core.placement.queue(ex)
        if merge.dedicated_to is not None:
            assert all(r.ask.adapter == merge.dedicated_to for r in queue), \
                f"{where}: dedicated to {merge.dedicated_to}, queues another adapter"
        # Slots: pins (and the deferred ones: left while steps with their rows were in flight),
        # each adapter in one slot and in its pages, as many pages as the blocks count.
        part.check(where, pins, steps.steps_answered, running)
        blocks = ex.blocks
        assert set(blocks.tables) == set(running), f"{where}: blocks of unknown sequences"
        blocks.check()  # every block free, cached or referenced, by as many as hold it
        in_tables = {b for seq_id in blocks.tables for b in blocks.held(seq_id)}
        assert len(in_tables) == blocks.num_allocated(), f"{where}: blocks leaked"
        holder: dict[int, Request] = {}
        for seq in running.values():
            held = blocks.capacity(seq.seq_id)
            num_computed, _, _ = steps.counters(seq)
            assert num_computed <= seq.capacity <= held, \
                f"{where}: seq {seq.seq_id} computes past its blocks, or believes it holds more"
            key = seq.request.cache_key
            for block in blocks.held(seq.seq_id):
                other = holder.setdefault(block, seq.request)
                assert other is seq.request or key and other.cache_key == key, \
                    f"{where}: block {block} shared across cache keys"
        demand: Counter[AdapterRef | None] = Counter()
        for req in queue:
            assert req.status is Status.QUEUED and req.executor is ex, \
                f"{where}: request {req.serial} misfiled"
            queued_by_tenant[req.ask.tenant] += 1
            placed[id(req)] += 1
            demand[req.ask.adapter] += 1
        assert demand == Counter(queue.demand), f"{where}: adapter demand counts drifted"
        assert len(queue) == sum(demand.values()), f"{where}: queue length drifted"
    assert queued_by_tenant == Counter(core.fair.backlog), "tenant backlogs drifted"
    for req in live:
        if req.status is not Status.FINISHED:
            assert placed[id(req)] == 1, f"request {req.serial} is in {placed[id(req)]} places"
