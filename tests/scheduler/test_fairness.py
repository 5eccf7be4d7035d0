"""Fairness of admission across tenants (virtual token counters with adapter-load charges)."""

import random

from scheduler.fairness import FairnessWeights, spread_bound
from scheduler.limits import Limits
from scheduler.request import Status
from tests.scheduler.sched_world import World, ref


def backlogged_spread(w: World) -> float:
    counters = [w.core.fair.counter(t) for t in w.core.fair.backlog]
    return max(counters) - min(counters) if len(counters) > 1 else 0.0


def keep_backlogged(w: World, tenant: str, depth: int, **kw) -> None:
    queued = sum(1 for r in w.requests if r.ask.tenant == tenant and r.status is Status.QUEUED)
    for _ in range(depth - queued):
        w.request(tenant, **kw)


def test_two_backlogged_tenants_stay_within_the_stated_bound():
    rng = random.Random(1)
    limits = Limits(max_num_seqs=4, max_batched_tokens=64, fairness_window=0.0)
    w = World(num_blocks=200, limits=limits)
    max_prompt, max_new = 40, 6
    bound = spread_bound(w.core.fair.weights, 0.0, max_prompt, 0.0, limits.max_num_seqs * max_new)
    worst = 0.0
    for _ in range(400):
        for tenant in ("a", "b"):
            keep_backlogged(w, tenant, 3, prompt_len=rng.randint(1, max_prompt),
                            max_new=rng.randint(1, max_new))
        w.complete_loads()
        w.step()
        worst = max(worst, backlogged_spread(w))
    assert worst <= bound, (worst, bound)
    served = {t: w.core.fair.counter(t) for t in ("a", "b")}
    assert abs(served["a"] - served["b"]) <= bound


def test_tenant_cycling_cold_adapters_pays_for_its_loads_and_gets_no_more_than_its_share():
    limits = Limits(max_num_seqs=4, fairness_window=0.0)
    w = World(num_slots=3, num_blocks=200, limits=limits, weights=FairnessWeights(load_weight=1.0))
    cold_adapters = [ref(f"cold{i}@1") for i in range(12)]
    tokens = {"hot": 0, "cold": 0}
    for i in range(300):
        keep_backlogged(w, "hot", 3, adapter="hot@1", prompt_len=8, max_new=4)
        keep_backlogged(w, "cold", 3, adapter=cold_adapters[i % len(cold_adapters)],
                        prompt_len=8, max_new=4)
        w.complete_loads()
        w.step()
    for req in w.requests:
        if req.admitted_at is not None:
            tokens[req.ask.tenant] += len(req.ask.prompt_ids) + req.output.num_tokens
    loads_caused = sum(r.charges.caused_load for r in w.requests if r.ask.tenant == "cold")
    token_charges = sum(len(r.ask.prompt_ids) + 2 * r.output.num_tokens
                        for r in w.requests if r.ask.tenant == "cold" and r.admitted_at is not None)
    assert loads_caused > 10
    assert w.core.fair.counter("cold") > token_charges, "its loads are on its bill"
    assert tokens["cold"] <= tokens["hot"], tokens


def test_fairness_window_bounds_the_gap_while_a_tenant_waits_for_its_adapter():
    limits = Limits(max_num_seqs=2, fairness_window=40.0)
    w = World(num_slots=2, num_blocks=200, limits=limits)
    bound = spread_bound(w.core.fair.weights, 40.0, 8, w.executors[0].rates.load_seconds(2**20)
                         * w.executors[0].rates.tokens_per_second, limits.max_num_seqs * 20)
    worst = 0.0
    for i in range(300):
        keep_backlogged(w, "hot", 3, adapter="hot@1", prompt_len=8, max_new=20)
        keep_backlogged(w, "cold", 1, adapter=f"c{i % 5}@1", prompt_len=8, max_new=2)
        if i % 30 == 0:  # slow loads: the cold tenant waits while the hot one could run ahead
            w.complete_loads()
        w.step()
        worst = max(worst, backlogged_spread(w))
    assert worst <= bound, (worst, bound)


def test_under_sustained_overload_every_light_request_is_admitted_within_a_bound():
    """Two tenants keep every slot pinned; a third sends a request for a cold adapter now and then.
    A reserved slot drains for it, so it waits at most about one heavy sequence's life."""
    heavy_len = 12
    limits = Limits(max_num_seqs=6, max_batched_tokens=64)
    w = World(num_slots=2, num_blocks=400, limits=limits)
    waits = []
    light = None
    for i in range(600):
        keep_backlogged(w, "h1", 4, adapter="h1@1", prompt_len=4, max_new=heavy_len)
        keep_backlogged(w, "h2", 4, adapter="h2@1", prompt_len=4, max_new=heavy_len)
        if i % 40 == 5:
            light = w.request("light", adapter=f"l{i}@1", prompt_len=4, max_new=2)
            arrived = i
        w.complete_loads()
        w.step()
        if light is not None and light.admitted_at is not None:
            waits.append(i - arrived)
            light = None
    assert len(waits) >= 14, "every light request got in"
    assert max(waits) <= 2 * heavy_len + 4, waits


def test_an_idle_executor_is_not_held_by_the_window_for_an_adapter_that_cannot_get_a_slot():
    """Tenant a, far ahead, has queued requests for x and y, which sit loaded in both slots;
    tenant b waits for z, which can take neither (both wanted, neither used yet). The window
    holds a back and z waits for a slot: with nothing running and nothing loading, the executor
    must take a's requests (it used to sit idle until the queue bound failed everyone)."""
    w = World(num_blocks=400, block_size=4, num_slots=2,
              limits=Limits(max_num_seqs=8, max_batched_tokens=256, fairness_window=50.0))
    ex = w.executors[0]
    requests = [w.request("a", "x@1", prompt_len=150, max_new=50),
                w.request("a", "y@1", prompt_len=2, max_new=50),
                w.request("b", "z@1", prompt_len=2, max_new=5),
                w.request("b", "z@1", prompt_len=2, max_new=5)]
    w.complete_loads()
    w.step()  # a's two run: a is ~150 ahead of b
    w.core.on_executor_lost(ex)  # it reconnects: a's requests, routed first, load x and y
    w.executors[0] = w.core.add_executor(ex.address, w.shape)
    for _ in range(300):
        w.complete_loads()
        w.step()
    assert all(w.finished(r) for r in requests)
