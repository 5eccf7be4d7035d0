"""Adapters under memory pressure (issue 47): when the adapters wanted do not fit beside the running
KV, admission serves the queued requests of resident adapters before evicting those adapters,
and each adapter loads once per wave (admission.py, placement.py: kv_ahead,
residency/executor_residency.py: _load_staged). Stats and /metrics count the adapters evicted
before they served what they were loaded for (early evictions)."""

import collections

import pytest

from common.adapter_pages import PageGeometry, plan_pages
from loraplex.admin_cli import format_stats
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.metrics import SchedulerMetrics
from scheduler.stats_pb import stats_pb
from tests.scheduler.sched_world import World, ref

SHAPES = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128),
          "o_proj": (256, 256), "gate_proj": (256, 688), "up_proj": (256, 688),
          "down_proj": (688, 256)}
GEOMETRY = PageGeometry(num_layers=2, region_elems=1024, module_shapes=SHAPES)
QV = {"q_proj": 16, "v_proj": 16}
PAGES = plan_pages(QV, GEOMETRY).num_pages  # 7
NUM_ADAPTERS = 16


class Recorder:
    """A world whose loads are counted per adapter, and whose every eviction is checked: none
    of an adapter that queued requests want while sequences run (the fallback with nothing
    running may take one: it must start someone)."""

    def __init__(self, num_blocks: int, **kwargs):
        self.w = World(num_slots=NUM_ADAPTERS, num_blocks=num_blocks, geometry=GEOMETRY,
                       **kwargs)
        self.ex = self.w.executors[0]
        self.loads: collections.Counter = collections.Counter()
        self.wanted_evicted: list = []
        unload = self.w._unload

        def checked_unload(ex, slot, adapter, done=None):
            if self.w.running(ex) and adapter in self.w.core.placement.wanted(ex):
                self.wanted_evicted.append(adapter)
            unload(ex, slot, adapter, done)
        self.w._unload = checked_unload  # (the core calls the world's at each unload)

    def wave(self, tenants=("t",), load_every: int = 1) -> int:
        """Every adapter's request at once (tenants in turn), run until drained, loads ending
        every `load_every` steps; the steps it took."""
        reqs = [self.w.request(tenant=tenants[i % len(tenants)], adapter=f"a{i}@1", ranks=QV,
                               prompt_len=10, max_new=8) for i in range(NUM_ADAPTERS)]
        for step in range(1, 1000):
            if step % load_every == 0:
                self.w.complete_loads(loaded=lambda slot, adapter: self.loads.update([adapter]))
            self.w.step()
            if not self.w.core.has_work(self.ex) and not (self.w.loads or self.w.stages):
                assert all(self.w.finished(r) for r in reqs)
                return step
        raise AssertionError("the wave did not drain")

    def counters(self):
        return self.w.core.residency.of(self.ex).counters()


@pytest.mark.parametrize("num_blocks", [100, 130, 160])
@pytest.mark.parametrize("load_every", [1, 3])
def test_waves_over_more_adapters_than_fit_load_each_adapter_once_per_wave(num_blocks,
                                                                           load_every):
    """16 adapters of 7 pages and 16 requests of 5 blocks each (at their end) in 100-160
    blocks: not everything fits at once. Three waves, one after the other: in each, an adapter
    loads at most once, none is evicted while its requests wait and sequences run, none soon
    after its load; the third wave loads no more than the second (the waves settle)."""
    r = Recorder(num_blocks)
    per_wave = []
    for _ in range(3):
        r.loads.clear()
        r.wave(load_every=load_every)
        assert max(r.loads.values(), default=0) <= 1, r.loads
        per_wave.append(sum(r.loads.values()))
    assert per_wave[0] == NUM_ADAPTERS and per_wave[2] <= per_wave[1] < NUM_ADAPTERS
    assert r.wanted_evicted == []
    assert r.counters().early_evictions == 0


def test_a_resident_adapters_queued_requests_run_before_it_is_evicted():
    """Every adapter is resident from a wave before (nothing evicted them) and each is wanted
    again, but their requests' KV does not fit beside them all: the requests run in turns, as
    KV frees, and no adapter is loaded again (the old admission started them all, and their
    growing KV evicted the adapters of the requests it had preempted)."""
    r = Recorder(160)
    r.wave()
    resident = {s.adapter for s in r.w.slots() if s.adapter}
    r.loads.clear()
    r.wave()
    assert not set(r.loads) & resident, r.loads
    assert sum(r.loads.values()) == NUM_ADAPTERS - len(resident)
    assert r.wanted_evicted == [] and r.counters().early_evictions == 0


def test_a_load_leaves_the_kv_of_the_requests_queued_ahead_of_its_own():
    """A base-model request queued first will take 36 of the 40 blocks as it grows; a request
    for cold adapter c (7 pages) comes next. c loads only once the base request no longer
    needs those blocks (the old scheduler loaded it at once, then the base request's growth
    evicted it, and it loaded again: twice for one request)."""
    r = Recorder(40, limits=Limits(kv_reserve=0.0))
    loads = []
    base = r.w.request(prompt_len=4, max_new=4 * 36 - 4)
    cold = r.w.request(adapter="c@1", ranks=QV, prompt_len=4, max_new=4)
    while not (r.w.finished(base) and r.w.finished(cold)):
        r.w.complete_loads(loaded=lambda slot, adapter: loads.append(adapter))
        r.w.step()
    assert loads == [ref("c@1")]
    assert cold.admitted_at > base.admitted_at and base.executor_failures == 0
    assert r.counters().evictions == 0


def test_evictions_before_an_adapter_served_anyone_are_counted_in_stats_and_metrics():
    """c loads for a request of t2; before it starts, a request of t1 (fairer: t2 paid for the
    load) comes that fits only in c's pages, with nothing running (nothing else could ever
    make room): c goes before it served anyone, an early eviction, and loads again for t2's
    request. Evicted the same way once it served it, it is an eviction only."""
    w = World(num_slots=2, num_blocks=10, geometry=GEOMETRY, limits=Limits(kv_reserve=0.0))
    ex = w.executors[0]
    waiting = w.request(tenant="t2", adapter="c@1", ranks=QV, prompt_len=2, max_new=1)
    w.complete_loads()
    w.request(tenant="t1", prompt_len=4 * (10 - PAGES) + 1, max_new=1)
    w.run()
    counters = w.core.residency.of(ex).counters()
    assert w.finished(waiting) and counters.loads == 2
    assert (counters.evictions, counters.early_evictions) == (1, 1)
    w.request(tenant="t1", prompt_len=4 * (10 - PAGES) + 1, max_new=1)  # (c served: not early)
    w.run()
    stats = w.operators.stats().executors[0]
    assert (stats.num_evictions, stats.num_early_evictions) == (2, 1)
    response = stats_pb(w.operators.stats())
    pb = response.executors[0]
    assert (pb.adapter_evictions, pb.adapter_early_evictions) == (2, 1)
    assert "2 adapters evicted for room, 1 before they served anyone" in format_stats(response)
    scraped = {m.name: m for m in SchedulerMetrics(w.core).registry.collect()}
    sample = scraped["loraplex_adapter_early_evictions"].samples[0]
    assert sample.value == 1 and sample.labels == {"executor": ex.address}


def test_loads_are_still_charged_to_the_tenants_that_cause_them():
    """Fairness counts loads (virtual time): two tenants' waves over the adapters, each
    tenant's counter is its tokens plus the loads its requests caused."""
    r = Recorder(130)
    r.wave(tenants=("x", "y"))
    totals = r.w.core.totals
    assert totals["x"].adapter_loads_caused + totals["y"].adapter_loads_caused == NUM_ADAPTERS
    fair = r.w.core.fair
    for tenant in ("x", "y"):
        t = totals[tenant]
        tokens = (fair.weights.input_weight * t.prompt_tokens
                  + fair.weights.output_weight * t.completion_tokens)
        assert fair.counter(tenant) > tokens  # (the loads' charge on top)


def test_under_pressure_nobody_overtakes_the_fairest_request_that_does_not_fit():
    """A base request runs and grows; c loads for t1's r1, whose whole run does not fit beside
    that growth: c sits idle and wanted (pressure), r1 waits. t2's later, small request r2
    would fit, but t2 was served before (its counter is ahead) and r1 is first in fair order:
    r2 does not start before it. Once the base request ends (nothing runs), r1 starts on its
    prompt: nobody waits for good."""
    w = World(num_slots=2, num_blocks=40, geometry=GEOMETRY, weights=FairnessWeights(
        load_weight=0.0), limits=Limits(kv_reserve=0.0))
    base = w.request(tenant="t0", prompt_len=4, max_new=40)  # 11 blocks at its end
    served = w.request(tenant="t2", prompt_len=4, max_new=1)
    w.step()
    r1 = w.request(tenant="t1", adapter="c@1", ranks=QV, prompt_len=4, max_new=100)
    w.complete_loads()
    r2 = w.request(tenant="t2", prompt_len=4, max_new=4)
    part = w.core.residency.of(w.executors[0])
    w.step()
    assert w.finished(served) and part.keeps_wanted_idle()
    assert r1.admitted_at is None and r2.admitted_at is None
    w.run()
    assert all(w.finished(r) for r in (base, r1, r2))
    assert base.admitted_at < r1.admitted_at <= r2.admitted_at
    assert part.counters().evictions == 0


def test_a_load_is_not_held_back_for_a_request_that_needs_its_reserved_slots_pages():
    """Nothing runs. c (7 pages) is READY in one of two slots and t0 queues for it; t2's base
    request, queued first, will need 14 of the 20 blocks, 13 free beside c's pages. t1, the
    fairest, waits for a: a's load may not take the blocks of the requests queued ahead, so a is
    staged and c's slot reserved for it; t2's request cannot take the pages of a reserved slot.
    Held back for that request, a's load would wait for good, and every request with it."""
    w = World(num_slots=2, num_blocks=20, geometry=GEOMETRY, limits=Limits(kv_reserve=0.0))
    w.request(tenant="t0", adapter="c@1", ranks=QV, prompt_len=8, max_new=8)
    w.request(tenant="t2", prompt_len=4, max_new=2)
    w.run()  # (c loaded; t0 served more than t2, t1 nothing)
    base = w.request(tenant="t2", prompt_len=4, max_new=4 * 14 - 4)
    w.now += 1.0
    for_c = w.request(tenant="t0", adapter="c@1", ranks=QV, prompt_len=4, max_new=4)
    for_a = w.request(tenant="t1", adapter="a@1", ranks=QV, prompt_len=4, max_new=4)
    w.run()
    assert all(w.finished(r) for r in (base, for_c, for_a))
