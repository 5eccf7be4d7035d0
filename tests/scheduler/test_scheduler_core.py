"""The scheduler's policy without gRPC: admission, residency, preemption, cancel, load failures
(driven by tests/scheduler/sched_world.py)."""

import random

import pytest

from common.detokenizer import Finish
from common.errors import FailedPrecondition, InvalidArgument, Unavailable
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.request import ErrorEvent, Status, TokenEvent
from scheduler.residency import prewarm
from scheduler.residency.slots import SlotState
from scheduler.sim.invariants import check_invariants
from scheduler.steps.sequence import NO_SAMPLES
from tests.scheduler.sched_world import World, ref


def test_request_waits_for_its_adapter_then_runs_pinned():
    w = World()
    req = w.request(adapter="a@1")
    assert len(w.loads) == 1, "queueing a request for a cold adapter starts its load (prefetch)"
    w.step()
    assert req.status is Status.QUEUED, "not admitted before the adapter is ready"
    w.complete_loads()
    w.step()
    assert req.status is Status.RUNNING and w.slot("a@1").pins == 1
    w.run()
    tokens = [e for e in w.events[req.serial] if isinstance(e, TokenEvent)]
    assert len(tokens) == 4 and req.finish_reason is Finish.LENGTH
    slot = w.slot("a@1")
    assert slot.pins == 0 and slot.state is SlotState.READY, "an unpinned adapter stays resident"


def test_pinned_slots_are_never_evicted_and_requests_wait_instead_of_failing():
    w = World(num_slots=2)
    a, b = w.request(adapter="a@1", max_new=50), w.request(adapter="b@1", max_new=50)
    w.complete_loads()
    w.step()
    c = w.request(adapter="c@1", max_new=2)
    assert not w.loads, "both slots are pinned: no load may evict them"
    for _ in range(10):
        w.step()
    assert c.status is Status.QUEUED and not w.events[c.serial]
    w.run()
    assert all(w.finished(r) for r in (a, b, c))


def test_an_adapter_waiting_for_a_slot_is_staged_on_the_executor_meanwhile():
    w = World(num_slots=1)
    w.request(adapter="a@1", max_new=50)
    assert not w.stages and len(w.loads) == 1, "a free slot: the load itself fetches it"
    w.complete_loads()
    w.step()
    w.request(adapter="a@1", max_new=1)
    b = w.request(adapter="b@1", max_new=1)
    assert [adapter for _, adapter in w.stages] == [ref("b@1")] and not w.loads, \
        "the only slot is pinned: stage b, load nothing"
    w.run()
    assert w.finished(b)


def test_stage_before_evict_a_ready_adapter_keeps_its_slot_while_the_store_is_down():
    w = World(num_slots=1, limits=Limits(load_backoff_s=0.5))
    hot = w.request(adapter="hot@1", max_new=1)
    w.run()
    assert w.finished(hot)
    cold = w.request(adapter="cold@1", max_new=1)
    assert w.stages and not w.loads, "the slot stays hot's until cold's bytes are staged"
    w.complete_loads(error=Unavailable("store frozen"))
    for _ in range(3):  # hot keeps being served from its slot meanwhile (within the backoff)
        again = w.request(adapter="hot@1", max_new=2)
        for _ in range(8):
            w.step()
        assert w.finished(again) and cold.status is Status.QUEUED and not w.loads
    w.now += 1.0  # past the backoff: staged, then it takes the slot
    w.core.expire()
    w.run()
    assert w.finished(cold)


def test_prewarm_with_no_executor_admitting_is_unavailable_not_a_silent_ok():
    w = World(num_executors=2)
    chosen = w.operators.prewarm(ref("a@1"), 1 << 20, 1, pin=False)
    assert [ex.address for ex in chosen] == ["ex0"]
    for ex in w.executors:
        w.core.drain(ex)
    with pytest.raises(Unavailable, match="no executor is up and admitting"):
        w.operators.prewarm(ref("b@1"), 1 << 20, 1, pin=False)


async def test_prewarm_waiters_hear_when_each_load_ends():
    """A waiting Prewarm is told by the loads themselves (no polling): ready, failed, or lost
    with its executor."""
    w = World(num_executors=3)
    chosen = w.operators.prewarm(ref("a@1"), 1 << 20, 3, pin=True)
    assert all(w.slot("a@1", ex).is_admin_pinned for ex in chosen)
    done = prewarm.loads_done(w.core.residency, chosen, ref("a@1"))
    (ok, bad, lost), w.loads = w.loads, []
    w.core.on_load_done(*ok, None)
    w.core.on_load_done(*bad, InvalidArgument("bad shapes"))
    assert not done.done(), "one load is still running"
    w.core.on_executor_lost(lost[0])
    assert await done == [bad[0].address, lost[0].address]
    assert await prewarm.loads_done(w.core.residency, chosen, ref("a@1")) == \
        [bad[0].address, lost[0].address]


def test_resume_is_refused_for_an_executor_leaving_stopping_or_down():
    w = World(num_executors=3)
    leaving, stopping, down = w.executors
    w.core.leave(leaving)
    w.core.stop(stopping)
    w.core.on_executor_lost(down)
    for ex in w.executors:
        with pytest.raises(FailedPrecondition, match="cannot admit work"):
            w.core.resume(ex)
        assert not ex.is_admitting
    assert w.core.is_retired(leaving) and w.core.is_retired(stopping)
    assert not w.core.is_retired(down)


def test_stats_count_every_ended_request_of_a_tenant():
    w = World()
    done, cancelled = w.request(tenant="t", max_new=2), w.request(tenant="t", max_new=50)
    w.step()
    w.core.cancel(cancelled)
    w.run()
    assert w.finished(done)
    (tenant,) = w.operators.stats().tenants
    assert (tenant.tenant, tenant.queued, tenant.running) == ("t", 0, 0)
    assert tenant.totals.requests == 2 and tenant.totals.prompt_tokens == 10
    assert tenant.totals.completion_tokens == 2 + cancelled.output.num_tokens
    (ex,) = w.operators.stats().executors
    assert ex.free_kv_blocks == ex.num_kv_blocks and ex.is_up and not ex.is_draining


def test_resume_undoes_drain_and_queued_work_moves_back():
    w = World(num_executors=2, limits=Limits(max_num_seqs=1))
    first, second = w.executors
    w.core.drain(first)
    reqs = [w.request(prompt_len=4, max_new=20) for _ in range(4)]
    assert all(r.executor is second for r in reqs), "a draining executor takes nothing"
    w.core.resume(first)
    assert not first.is_draining and any(r.executor is first for r in reqs), "queue rebalanced"
    w.run()
    assert all(w.finished(r) for r in reqs)
    for ex in w.executors:  # every executor drained: requests wait with nowhere to go ...
        w.core.drain(ex)
    waiting = w.request(prompt_len=4, max_new=3, tenant="late")
    assert waiting.executor is None
    (late,) = [t for t in w.operators.stats().tenants if t.tenant == "late"]
    assert late.queued == 1  # (Stats shows it waiting: it counted no queue of an executor)
    w.core.resume(second)  # ... until one admits again
    assert waiting.executor is second
    w.run()
    assert w.finished(waiting)


def test_lru_evicts_the_least_recently_used_unpinned_slot():
    w = World(num_slots=2)
    for name in (ref("a@1"), ref("b@1")):
        w.request(adapter=name, max_new=1)
        w.run()
    w.request(adapter="a@1", max_new=1)  # touch a: b is now least recently used
    w.run()
    w.request(adapter="c@1", max_new=1)
    w.run()
    held = {s.adapter for s in w.slots()}
    assert held == {ref("a@1"), ref("c@1")}


def test_rows_of_one_step_are_sorted_by_adapter_and_all_requests_finish():
    rng = random.Random(0)
    w = World(num_slots=4, num_blocks=200)
    adapters = ["", ref("a@1"), ref("b@1"), ref("c@1")]
    reqs = [w.request(tenant=f"t{i % 3}", adapter=rng.choice(adapters),
                      prompt_len=rng.randint(1, 20), max_new=rng.randint(1, 10)) for i in range(40)]
    w.run()
    assert all(w.finished(r) for r in reqs)
    ex = w.executors[0]
    assert ex.blocks.num_free == ex.blocks.num_blocks


def test_kv_pressure_preempts_and_recomputes_without_losing_requests():
    w = World(num_blocks=12, block_size=4, limits=Limits(max_num_seqs=8))
    reqs = [w.request(prompt_len=6, max_new=12) for _ in range(4)]
    w.run()
    for req in reqs:
        tokens = [e for e in w.events[req.serial] if isinstance(e, TokenEvent)]
        assert len(tokens) == 12, "a preempted request resumes; nothing is lost or repeated"
    assert w.executors[0].blocks.num_free == 12


def test_chunked_prefill_respects_the_token_budget():
    w = World(num_blocks=64, limits=Limits(max_batched_tokens=8))
    req = w.request(prompt_len=30, max_new=2)
    plan = w.core.schedule(w.executors[0])
    assert [row.num_tokens for row in plan.rows] == [8]
    w.core.on_step_done(w.executors[0], plan, NO_SAMPLES)
    w.run()
    assert w.finished(req)


def test_cancel_frees_blocks_and_pins_whether_queued_or_running():
    w = World()
    running = w.request(adapter="a@1", max_new=100)
    w.complete_loads()
    w.step()
    queued = w.request(adapter="zzz@1")
    (seq_id,) = w.running()
    w.core.cancel(running)
    w.core.cancel(queued)
    check_invariants(w.core, w.requests)
    ex = w.executors[0]
    assert ex.blocks.num_free == ex.blocks.num_blocks and not w.running(ex)
    assert w.slot("a@1").pins == 0 and len(w.queue(ex)) == 0
    assert w.core.schedule(ex).freed == [seq_id], "the executor is told to forget it"


def test_invalid_adapter_fails_at_once():
    w = World()
    req = w.request(adapter="bad@1")
    w.complete_loads(error=InvalidArgument("shape mismatch"))
    (event,) = w.events[req.serial]
    assert isinstance(event.error, InvalidArgument) and req.status is Status.FINISHED


def test_executor_loss_requeues_its_work_on_another_executor():
    w = World(num_executors=2)
    reqs = [w.request(prompt_len=4, max_new=6) for _ in range(6)]
    w.step()
    lost = w.executors[0]
    w.core.on_executor_lost(lost)
    assert not w.running(lost)
    w.run()
    assert all(w.finished(r) for r in reqs)


def test_a_request_under_which_executors_keep_failing_fails_after_the_limit():
    """A request whose step fails every time (the executor errors, the scheduler reconnects and
    recomputes it) must not loop forever: at its max_executor_failures-th lost executor it gets
    the error. Requests that were only queued there are not counted."""
    w = World(limits=Limits(max_num_seqs=1, max_executor_failures=3))
    poison, queued = w.request(prompt_len=4, max_new=50), w.request(prompt_len=4, max_new=50)
    for attempt in range(1, 4):
        w.step()
        assert poison.status is Status.RUNNING and queued.status is Status.QUEUED
        lost = w.executors[0]
        w.core.on_executor_lost(lost, Unavailable("step failed: boom"))
        # It reconnects: a fresh view of it.
        w.executors[0] = w.core.add_executor(lost.address, w.shape)
        if attempt < 3:
            assert poison.status is Status.QUEUED
            assert not any(isinstance(e, ErrorEvent) for e in w.events[poison.serial])
    (event,) = [e for e in w.events[poison.serial] if isinstance(e, ErrorEvent)]
    assert isinstance(event.error, Unavailable) and "3 executors failed" in str(event.error)
    assert "boom" in str(event.error) and poison.status is Status.FINISHED
    check_invariants(w.core)
    w.run()
    assert w.finished(queued) and queued.executor_failures < 3
    assert all(ex.blocks.num_free == ex.blocks.num_blocks for ex in w.executors)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0)])
def test_backlogged_tenants_share_admissions_by_weight(weights):
    w = World(limits=Limits(max_num_seqs=1),
              weights=FairnessWeights(tenant_weights={"a": weights[0], "b": weights[1]}))
    reqs = [w.request(tenant=t, prompt_len=10, max_new=1) for t in ("a", "b") for _ in range(30)]
    for _ in range(40):
        w.step()
    admitted = [r.ask.tenant for r in sorted((r for r in reqs if r.admitted_at),
                                         key=lambda r: r.admitted_at)]
    first = admitted[:15]
    share = first.count("a") / len(first)
    assert share == pytest.approx(weights[0] / sum(weights), abs=0.1)


def test_long_prompts_cost_their_tenant_more_service():
    """Input tokens are charged: a tenant sending 10x longer prompts gets ~1/9 the admissions."""
    w = World(num_blocks=64, limits=Limits(max_num_seqs=1))
    reqs = [w.request(tenant=t, prompt_len=n, max_new=1) for t, n in (("long", 100), ("short", 10))
            for _ in range(30)]
    for _ in range(60):
        w.step()
    admitted = [r.ask.tenant for r in sorted((r for r in reqs if r.admitted_at),
                                         key=lambda r: r.admitted_at)]
    served = {t: sum((100 if t == "long" else 10) + 2 for a in admitted[:20] if a == t)
              for t in ("long", "short")}
    assert abs(served["long"] - served["short"]) <= 2 * (100 + 2), served


def test_adapter_loads_are_charged_to_the_tenant_that_causes_them():
    w = World(num_slots=8)
    w.request(tenant="cold", adapter="x@1", max_new=1)
    w.request(tenant="hot", max_new=1)
    counters = w.core.fair.counters
    rates = w.executors[0].rates
    expected = rates.load_seconds(2**20) * rates.tokens_per_second  # the 1 MiB adapter's load
    assert counters["cold"] == pytest.approx(expected)
    assert counters.get("hot", 0.0) == pytest.approx(counters["cold"]), \
        "lifted on arrival, not charged"


def test_distinct_adapters_per_batch_are_limited():
    w = World(num_slots=4, limits=Limits(max_adapters_per_batch=2))
    reqs = [w.request(adapter=ref(a), max_new=6) for a in ("a@1", "b@1", "c@1", "d@1")]
    w.complete_loads()
    for _ in range(3):
        w.step()
        running = {seq.request.ask.adapter for seq in w.running().values()}
        assert len(running) <= 2
    w.run()
    assert all(w.finished(r) for r in reqs)
