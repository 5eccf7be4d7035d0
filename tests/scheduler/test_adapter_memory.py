"""Adapters in pages of the KV blocks (scheduler/residency/adapter_memory.py): each takes pages in
proportion to its ranks, they grow into KV that idles and give it back under KV pressure, and
no running sequence ever loses its adapter or its blocks to a load."""

import grpc
import pytest

from common.adapter_pages import PageGeometry, plan_pages
from common.errors import InvalidArgument
from scheduler.limits import Limits
from scheduler.request import ErrorEvent, Status
from scheduler.residency.slots import SlotState, SlotTable
from scheduler.steps.block_manager import BlockManager
from tests.scheduler.sched_world import World, ref

SHAPES = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128),
          "o_proj": (256, 256), "gate_proj": (256, 688), "up_proj": (256, 688),
          "down_proj": (688, 256)}
GEOMETRY = PageGeometry(num_layers=2, region_elems=1024, module_shapes=SHAPES)


def pages(ranks) -> int:
    return plan_pages(ranks, GEOMETRY).num_pages


def qv(rank: int) -> dict[str, int]:
    return {"q_proj": rank, "v_proj": rank}


def test_adapters_take_pages_in_proportion_to_their_ranks():
    w = World(num_slots=4, num_blocks=200, geometry=GEOMETRY)
    for name, rank in (("r1@1", 1), ("r8@1", 8), ("r32@1", 32)):
        w.request(adapter=name, ranks=qv(rank))
    w.run()
    ex = w.executors[0]
    held = {s.adapter: s.num_pages for s in w.slots() if s.adapter}
    assert held == {ref("r1@1"): pages(qv(1)), ref("r8@1"): pages(qv(8)),
                    ref("r32@1"): pages(qv(32))}
    assert held[ref("r1@1")] < held[ref("r8@1")] and \
        3 * held[ref("r8@1")] <= held[ref("r32@1")] <= 4 * held[ref("r8@1")]
    assert ex.blocks.num_pages == sum(held.values())
    assert ex.blocks.num_free == 200 - sum(held.values())


def test_kv_pressure_takes_back_the_pages_of_adapters_nobody_uses():
    """Two adapters stay resident after their requests; a long prompt then needs nearly every
    block: their pages (and the prefix blocks they computed) go back to KV, no sequence is
    preempted, and the adapters load again when asked for."""
    w = World(num_slots=4, num_blocks=40, geometry=GEOMETRY, limits=Limits(kv_reserve=0.0))
    for name in ("a@1", "b@1"):
        w.request(adapter=name, ranks=qv(16), prompt_len=9)
    w.run()
    ex = w.executors[0]
    assert ex.blocks.num_pages == 2 * pages(qv(16)) and ex.blocks.num_cached > 0
    long = w.request(prompt_len=4 * 40 - 8, max_new=4)
    w.run()
    assert w.finished(long) and long.executor_failures == 0
    assert ex.blocks.num_pages == 0
    assert ex.blocks.drop_cached_of(ref("a@1")) == ex.blocks.drop_cached_of(ref("b@1")) == 0
    assert {a for _, _, a in w.unloads} == {ref("a@1"), ref("b@1")}
    again = w.request(adapter="a@1", ranks=qv(16))
    w.run()
    assert w.finished(again)


def test_a_slot_reserved_for_a_starving_adapter_gives_its_pages_to_a_growing_sequence():
    """A slot reserved to drain for a starving adapter (anti-starvation) kept its pages from KV,
    so a running sequence that needed them was preempted, admitted again at once from its cached
    prefix, and preempted again: thousands of times, until the reservation's staged bytes
    expired 60 s later (a reviewer's server: 8,947 preemptions). The reservation gives way."""
    w = World(num_slots=2, num_blocks=40, geometry=GEOMETRY,
              limits=Limits(kv_reserve=0.0, max_batched_tokens=24))  # (prompts in chunks)
    for name in ("a@1", "c@1"):
        w.request(adapter=name, ranks=qv(16), prompt_len=9)
    w.run()
    ex = w.executors[0]
    part = w.core.residency.of(ex)
    waiting = w.request(adapter="b@1", ranks=qv(16))  # (its staging never ends here)
    assert part._slots.reserve(ref("b@1")) is not None
    # (its prompt fits the blocks the reserved slot leaves; its output needs that slot's pages)
    long = w.request(prompt_len=128, max_new=28)
    for _ in range(60):
        w.step()
        if w.finished(long):
            break
    assert w.finished(long) and w.core.preemptions[ex.address] == 0
    assert not w.finished(waiting)  # (its turn comes once its bytes are staged)


def test_the_request_admission_stops_at_takes_pages_of_adapters_only_those_behind_it_want():
    """Adapter c stays resident, wanted by requests queued behind a fairer base-model request
    that fits the executor only with c's pages: c goes (it reloads for its requests later);
    kept, nothing could ever start (the fairest waits for c's pages, c's requests for it)."""
    w = World(num_slots=2, num_blocks=10, geometry=GEOMETRY, limits=Limits(kv_reserve=0.0))
    warm = w.request(tenant="t2", adapter="c@1", ranks=qv(16), prompt_len=2, max_new=1)
    w.run()
    ex = w.executors[0]
    assert w.finished(warm) and ex.blocks.num_pages == pages(qv(16)) > 0
    base = w.request(tenant="t1", prompt_len=4 * (10 - pages(qv(16))) + 1, max_new=1)
    later = w.request(tenant="t2", adapter="c@1", ranks=qv(16), prompt_len=2, max_new=1)
    w.run()
    assert w.finished(base) and w.finished(later)
    assert ref("c@1") in {a for _, _, a in w.unloads}


def test_a_running_adapter_keeps_its_pages_under_kv_pressure():
    """A sequence of adapter a runs; the base model's requests need more blocks than are free:
    a's pages are never taken (its sequence would read KV in them); requests wait or are
    preempted instead, and every one finishes."""
    w = World(num_slots=2, num_blocks=24, geometry=GEOMETRY, limits=Limits(kv_reserve=0.0))
    a = w.request(adapter="a@1", ranks=qv(16), prompt_len=3, max_new=60)
    w.complete_loads()
    w.step()
    a_pages = w.slot("a@1").pages
    others = [w.request(prompt_len=20, max_new=10) for _ in range(3)]
    for _ in range(40):
        w.step()
        if a.status is Status.RUNNING:
            assert w.slot("a@1").pages == a_pages
    w.run()
    assert w.finished(a) and all(w.finished(r) for r in others)


def test_adapters_grow_into_idle_kv_up_to_the_reserve():
    """KV idles: adapters take blocks until kv_reserve of them is left; the next load then
    evicts the least popular adapter instead of taking the reserve."""
    w = World(num_slots=16, num_blocks=40, geometry=GEOMETRY, limits=Limits(kv_reserve=0.5))
    each = pages(qv(8))
    names = [f"x{i}@1" for i in range(40 // each)]
    for name in names:
        w.request(adapter=name, ranks=qv(8), prompt_len=2, max_new=1)
        w.run()
    ex = w.executors[0]
    assert ex.blocks.num_pages <= 20 and ex.blocks.num_free >= 20
    assert ex.blocks.num_pages > 20 - each  # (as many as fit beside the reserve)
    assert len(w.unloads) >= len(names) - 20 // each


def test_a_load_that_cannot_find_pages_waits_and_takes_no_running_sequences_blocks():
    w = World(num_slots=2, num_blocks=12, geometry=GEOMETRY, limits=Limits(kv_reserve=0.0))
    runners = [w.request(prompt_len=10, max_new=10) for _ in range(2)]  # 2 x 5 blocks at the end
    w.step()
    cold = w.request(adapter="c@1", ranks=qv(8))  # 4 pages: not free while they run
    while any(r.status is Status.RUNNING for r in runners):
        w.complete_loads()
        assert w.slot("c@1") is None, "its pages were taken from the runners' KV"
        w.step()
    assert all(r.queued_since == r.arrival for r in runners), "a runner was preempted"
    w.run()
    assert all(w.finished(r) for r in runners) and w.finished(cold)


def test_a_staged_adapter_that_needs_most_blocks_takes_the_slot_whose_pages_it_counted():
    """Every slot holds an adapter nobody wants; a rank-64 adapter needs 28 of the 46 blocks:
    the free ones, its victim's pages and another adapter's. Evicting that other one empties a
    slot, and the load must still go into the victim it counted the pages of (it went into the
    emptied slot, found too few pages, and stayed LOADING for good: TypeError in a background
    task)."""
    w = World(num_slots=3, num_blocks=46, geometry=GEOMETRY, limits=Limits(kv_reserve=0.0))
    for name, rank in (("a@1", 16), ("b@1", 32), ("d@1", 32)):
        w.request(adapter=name, ranks=qv(rank), prompt_len=2, max_new=1)
        w.run()
    ex = w.executors[0]
    assert ex.blocks.num_pages == pages(qv(16)) + 2 * pages(qv(32))
    assert all(s.state is not SlotState.EMPTY for s in w.slots())
    big = w.request(adapter="big@1", ranks=qv(64), prompt_len=2, max_new=1)
    w.run()
    assert w.finished(big)
    held = {s.adapter: s.num_pages for s in w.slots() if s.adapter}
    assert held[ref("big@1")] == pages(qv(64)) == 28
    assert ex.blocks.num_pages == sum(held.values())
    assert not any(s.state is SlotState.LOADING for s in w.slots())


@pytest.mark.parametrize("ends", ["staging", "load"])
def test_a_bug_while_an_adapter_comes_in_leaves_nothing_half_done(monkeypatch, caplog, ends):
    """A bug raised where a staging or a load ends (here: starting the load the staging
    allows, or marking the slot ready) gives up what was under way for that adapter whole: no
    slot stays LOADING, no staging stays pending, its pages go back; the requests waiting for it
    fail at once with an internal error, logged once, and the adapter can be brought in
    again."""
    w = World(num_slots=2, num_blocks=40, geometry=GEOMETRY, limits=Limits(kv_reserve=0.0))
    ex = w.executors[0]
    if ends == "staging":  # (every slot taken: the adapter is staged before it evicts)
        for name in ("a@1", "b@1"):
            w.request(adapter=name, ranks=qv(8), prompt_len=2, max_new=1)
            w.run()
    waiting = w.request(adapter="c@1", ranks=qv(8), prompt_len=2, max_new=1)
    owner, name = (w, "_load") if ends == "staging" else (SlotTable, "mark_ready")
    monkeypatch.setattr(owner, name, lambda *a: 1 / 0)
    w.complete_loads()
    assert [r.levelname for r in caplog.records if "this is a bug" in r.getMessage()] == ["ERROR"]
    (event,) = error_events(w, waiting)
    assert event.error.code is grpc.StatusCode.INTERNAL and "this is a bug" in str(event.error)
    part = w.core.residency.of(ex)
    assert w.slot("c@1") is None and not part.is_staged(ref("c@1"))
    assert not part.is_bringing_in() and part.fetching_since(ref("c@1")) is None
    assert ex.blocks.num_pages == sum(s.num_pages for s in w.slots())
    monkeypatch.undo()
    again = w.request(adapter="c@1", ranks=qv(8), prompt_len=2, max_new=1)
    w.run()
    assert w.finished(again) and w.slot("c@1").state is SlotState.READY


def error_events(w: World, req) -> list:
    return [e for e in w.events[req.serial] if isinstance(e, ErrorEvent)]


def test_a_failed_load_keeps_its_pages_until_the_executor_answers_its_unload():
    """Its copy may outlive its RPC: the pages must not become KV until the executor says
    nothing writes them any more."""
    w = World(num_slots=2, num_blocks=40, geometry=GEOMETRY)
    answers = []
    w._unload = lambda ex, slot, adapter, done=None: answers.append(done)
    w.request(adapter="a@1", ranks=qv(16))
    ex = w.executors[0]
    w.complete_loads(error=InvalidArgument("bad shapes"))
    (index,) = [i for i, s in enumerate(w.slots()) if s.state is SlotState.CLEANING]
    assert ex.blocks.num_pages == pages(qv(16)) and w.slot("a@1") is None
    answers[-1](True)
    assert w.slots()[index].state is SlotState.EMPTY and ex.blocks.num_pages == 0


def test_blocks_a_sequence_left_become_pages_only_once_its_steps_are_answered():
    blocks = BlockManager(num_blocks=4, block_size=4)
    blocks.start(1, [], 16)
    blocks.free(1, last_step=7)
    assert blocks.num_free == 4 and blocks.take_pages(1) is None  # (KV may take them at once)
    blocks.settle(6)
    assert blocks.take_pages(1) is None
    blocks.settle(7)
    assert blocks.take_pages(4) is not None and blocks.num_pages == 4
    blocks.check()


@pytest.mark.parametrize("seed", range(4))
def test_paged_executors_drain_random_work_with_every_invariant(seed):
    import random

    rng = random.Random(seed)
    w = World(num_executors=2, num_slots=3, num_blocks=30, geometry=GEOMETRY,
              limits=Limits(max_num_seqs=4, max_batched_tokens=16, kv_reserve=0.2))
    ranks = {f"a{i}@1": qv(rng.choice([1, 4, 8, 16])) for i in range(6)}
    for _ in range(60):
        name = rng.choice([*ranks, ""])
        w.request(tenant=rng.choice("xyz"), adapter=name, ranks=ranks.get(name),
                  prompt_len=rng.randint(1, 20), max_new=rng.randint(1, 12))
        if rng.random() < 0.5:
            w.complete_loads()
        w.step()
    w.run(max_steps=3000)
    assert all(w.finished(r) for r in w.requests)
