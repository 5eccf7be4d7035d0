"""Every wait in the scheduler core is bounded (driven by sched_world.py): a client's
deadline, the pool's longest queue wait, a tenant's queue cap, an adapter no slot can ever take,
failed loads retried with backoff, and a sequence cancelled during its first step freed."""

import pytest

from common import wire
from common.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
)
from scheduler.executor_state import ExecutorShape
from scheduler.limits import Limits
from scheduler.request import ErrorEvent, Status
from scheduler.residency.executor_residency import STAGED_TTL_S
from scheduler.residency.slots import SlotState
from scheduler.steps.sequence import NO_SAMPLES
from tests.scheduler.sched_world import World, ref


def error_of(w: World, req):
    (event,) = [e for e in w.events[req.serial] if isinstance(e, ErrorEvent)]
    return event.error


def retry_after(error) -> float:
    return float(dict(error.trailers)[wire.RETRY_AFTER])


def test_a_failed_load_backs_off_doubling_then_fails_retryably_at_the_queue_bound():
    w = World(limits=Limits(load_backoff_s=0.5, max_load_backoff_s=1.0, max_queue_s=5.0))
    req = w.request(adapter="a@1")
    w.complete_loads(error=Unavailable("store down"))
    w.step()
    assert not w.loads, "not again before its backoff"
    w.now += 0.5
    w.core.expire()
    w.step()
    assert len(w.loads) == 1, "tried again once the backoff passed"
    w.complete_loads(error=Unavailable("store down"))
    w.now += 0.6
    w.step()
    assert not w.loads, "the backoff doubled to 1 s"
    w.now += 0.5
    w.step()
    assert len(w.loads) == 1
    w.complete_loads(error=Unavailable("store down"))
    assert req.status is Status.QUEUED, "a retryable failure never fails the request by itself"
    w.now = req.arrival + 5.0
    w.core.expire()
    error = error_of(w, req)
    assert isinstance(error, Unavailable) and "could not be loaded" in str(error)
    assert "store down" in str(error) and retry_after(error) > 0
    assert all(s.state is SlotState.EMPTY for s in w.slots())


def test_a_request_waits_at_most_max_load_wait_s_for_a_fetch_that_never_ends():
    """A frozen store or S3: the load neither succeeds nor fails. Its request ends UNAVAILABLE
    with retry-after max_load_wait_s after it began waiting (checked on the clock tick), while
    a request for a resident adapter and one for the base model are served meanwhile."""
    w = World(limits=Limits(max_load_wait_s=30.0))
    w.request(adapter="hot@1")
    w.complete_loads()
    w.run()
    cold = w.request(adapter="cold@1")
    assert w.loads, "its load is on its way (and will hang)"
    w.loads.clear()  # (it never answers)
    hot, base = w.request(adapter="hot@1"), w.request()
    for _ in range(29):
        w.now += 1.0
        w.core.expire()
        w.step()
    assert w.finished(hot) and w.finished(base) and cold.status is Status.QUEUED
    w.now = cold.arrival + 30.0
    w.core.expire()
    error = error_of(w, cold)
    assert isinstance(error, Unavailable) and "not loaded within 30s" in str(error)
    assert "still under way" in str(error) and retry_after(error) > 0


def test_failing_fetches_end_their_request_at_max_load_wait_s_not_at_the_queue_bound():
    w = World(limits=Limits(load_backoff_s=0.5, max_load_backoff_s=2.0, max_load_wait_s=10.0))
    req = w.request(adapter="a@1")
    for i in range(1, 19):
        w.complete_loads(error=Unavailable("S3 frozen"))
        w.now = req.arrival + 0.5 * i  # (retried as each backoff passes)
        w.core.expire()
        w.step()
    assert req.status is Status.QUEUED
    w.now = req.arrival + 10.0
    w.core.expire()
    error = error_of(w, req)
    assert isinstance(error, Unavailable) and "S3 frozen" in str(error)


def test_the_load_bound_counts_from_when_the_fetch_began_not_while_a_slot_is_awaited():
    """Both slots pinned by long requests: a request for a third adapter waits for a slot (no
    fetch under way) past max_load_wait_s and is not failed; once its fetch begins and hangs,
    it ends max_load_wait_s later."""
    w = World(num_slots=2, limits=Limits(max_load_wait_s=10.0, fairness_window=0.0))
    long_a, long_b = w.request(adapter="a@1", max_new=40), w.request(adapter="b@1", max_new=40)
    w.complete_loads()
    w.step()
    cold = w.request(adapter="c@1")
    for _ in range(15):
        w.now += 1.0
        w.core.expire()
        w.complete_loads()  # (its staging ends: its bytes wait on the host for a slot)
        w.step()
    assert cold.status is Status.QUEUED and not w.loads
    while w.slot("c@1") is None:  # the long ones drain
        w.complete_loads()
        w.step()
    began = w.now
    w.loads.clear()  # (its load hangs)
    w.now = began + 9.0
    w.core.expire()
    assert cold.status is Status.QUEUED
    w.now = began + 10.5
    w.core.expire()
    assert isinstance(error_of(w, cold), Unavailable)
    assert w.finished(long_a) and w.finished(long_b)


def test_a_load_that_succeeds_after_failures_serves_its_requests():
    w = World(limits=Limits(load_backoff_s=0.1))
    req = w.request(adapter="a@1", max_new=3)
    w.complete_loads(error=Unavailable("store down"))
    w.now += 0.2
    w.run()
    assert w.finished(req) and not w.core.residency.of(w.executors[0]).has_failing_loads()


def test_a_client_deadline_drops_a_waiting_request_and_frees_everything():
    w = World(num_slots=1)
    busy = w.request(adapter="a@1", max_new=100)
    w.complete_loads()
    w.step()
    # (the service sets a request's deadline from its gRPC deadline at arrival)
    waiting = w.request(adapter="b@1", deadline=w.now + 1.0)
    w.now += 1.0
    w.core.expire()
    assert isinstance(error_of(w, waiting), DeadlineExceeded)
    assert waiting.status is Status.FINISHED and len(w.queue()) == 0
    assert not w.core.fair.backlog.get("t") and busy.status is Status.RUNNING


def test_the_queue_bound_applies_while_no_executor_is_up():
    w = World(limits=Limits(max_queue_s=3.0))
    w.core.on_executor_lost(w.executors[0])
    req = w.request()
    assert req in w.core.placement.orphans
    w.now += 3.0
    w.core.expire()
    error = error_of(w, req)
    assert isinstance(error, ResourceExhausted) and 1 <= retry_after(error) <= 60
    assert not w.core.placement.orphans


def test_a_running_request_is_never_failed_by_the_queue_bound():
    w = World(num_blocks=128, limits=Limits(max_queue_s=1.0))
    req = w.request(max_new=400)
    w.step()
    w.now += 5.0
    w.core.expire()
    assert req.status is Status.RUNNING and not error_events(w, req)


def error_events(w: World, req) -> list:
    return [e for e in w.events[req.serial] if isinstance(e, ErrorEvent)]


def test_a_tenant_over_its_queue_cap_is_refused_with_retry_after():
    w = World(num_blocks=4, limits=Limits(max_queued_per_tenant=3))
    for _ in range(4):  # one admitted (all blocks), three queued
        w.request(tenant="greedy", prompt_len=10)
        w.step()
    with pytest.raises(ResourceExhausted, match="3 requests waiting") as err:
        w.request(tenant="greedy")
    assert retry_after(err.value) >= 1
    w.request(tenant="other")  # another tenant is not held back


def test_pins_leave_unpinned_slots_to_the_other_adapters():
    """Prewarm with pin stops at all slots but unpinned_slots (1): a third pin of three slots is
    refused, counting a pin whose load is still on its way; pinning a pinned adapter again is
    fine; and requests for four other adapters all run, taking turns in the slot left."""
    w = World(num_slots=3)
    w.operators.prewarm(ref("a@1"), 1 << 20, 1, pin=True)
    w.operators.prewarm(ref("b@1"), 1 << 20, 1, pin=True)  # (both still loading)
    with pytest.raises(FailedPrecondition, match="2 of its 3 adapter slots are pinned"):
        w.operators.prewarm(ref("c@1"), 1 << 20, 1, pin=True)
    w.operators.prewarm(ref("a@1"), 1 << 20, 1, pin=True)
    w.operators.prewarm(ref("c@1"), 1 << 20, 1, pin=False)  # unpinned: fine
    others = [w.request(adapter=f"x{i}@1") for i in range(4)]
    w.run()
    assert all(w.finished(req) for req in others)
    assert w.core.residency.of(w.executors[0]).admin_pinned() == {ref("a@1"), ref("b@1")}


def test_an_operators_pin_survives_its_executors_restart_until_evicted():
    """An executor that restarts comes back empty; what an operator pinned there is brought in
    and pinned again (it was silently gone: scheduler.proto's Prewarm pin keeps an adapter
    resident until evicted); an eviction ends the pin, also for the next restart."""
    w = World(num_slots=3)
    w.operators.prewarm(ref("a@1"), 1 << 20, 1, pin=True)
    w.operators.prewarm(ref("b@1"), 1 << 20, 1, pin=False)
    w.complete_loads()

    def restart():
        w.core.on_executor_lost(w.executors[0])
        w.executors[0] = w.core.add_executor("ex0", w.shape)
        w.complete_loads()
        return w.core.residency.of(w.executors[0])

    part = restart()
    assert part.admin_pinned() == {ref("a@1")} and w.slot("a@1").is_admin_pinned
    assert w.slot("b@1") is None  # (not pinned: gone with the restart)
    assert w.operators.evict(ref("a@1")) == 1
    assert restart().admin_pinned() == set() and w.slot("a@1") is None


def test_a_pin_promised_while_its_bytes_are_staged_counts_against_the_cap():
    w = World(num_slots=2)
    for adapter in ("a@1", "b@1"):  # both slots READY, unpinned, used
        w.request(adapter=adapter)
    w.run()
    w.operators.prewarm(ref("c@1"), 1 << 20, 1, pin=True)  # must evict: staged first, no slot yet
    assert w.stages and not w.loads
    with pytest.raises(FailedPrecondition, match="1 of its 2 adapter slots are pinned"):
        w.operators.prewarm(ref("d@1"), 1 << 20, 1, pin=True)
    w.complete_loads()
    assert w.slot("c@1").is_admin_pinned


def test_a_pin_is_refused_on_an_executor_of_one_slot():
    w = World(num_slots=1)
    with pytest.raises(FailedPrecondition, match="0 of its 1 adapter slots are pinned"):
        w.operators.prewarm(ref("a@1"), 1 << 20, 1, pin=True)


def test_an_adapter_no_slot_can_ever_take_is_refused():
    w = World(num_slots=1, limits=Limits(unpinned_slots=0))  # (pins may take every slot)
    w.operators.prewarm(ref("pinned@1"), 1 << 20, 1, pin=True)
    w.complete_loads()
    with pytest.raises(FailedPrecondition, match="pinned by an operator"):
        w.request(adapter="cold@1")
    w.request(adapter="pinned@1")  # the pinned one is served
    w.request()  # and the base model


def test_a_sequence_cancelled_during_its_first_step_is_freed_on_the_executor():
    w = World()
    req = w.request(max_new=5)
    ex = w.executors[0]
    plan = w.core.schedule(ex)
    (seq,) = plan.new
    w.core.cancel(req)  # while the step runs
    w.core.on_step_done(ex, plan, NO_SAMPLES)
    assert w.core.schedule(ex).freed == [seq.seq_id]


def test_a_tenant_whose_adapter_cannot_load_does_not_stall_the_others_by_the_window():
    """The fairness window stops a tenant far ahead of one that waits; but a tenant waiting on an
    adapter whose loads keep failing (a store down) cannot be served anyway: the others go on."""
    w = World(num_slots=2, limits=Limits(fairness_window=20.0, load_backoff_s=5.0,
                                         max_load_backoff_s=5.0))
    warm = w.request(tenant="hot", adapter="hot@1", max_new=1)
    w.run()
    assert w.finished(warm)
    w.request(tenant="cold", adapter="cold@1", max_new=1)
    w.complete_loads(error=Unavailable("store down"))  # cold's adapter backs off for 5 s
    served = []
    for i in range(20):  # each worth 12 token-equivalents: far past the window of 20
        req = w.request(tenant="hot", adapter="hot@1", prompt_len=4, max_new=4)
        for _ in range(10):
            w.step()
        served.append(w.finished(req))
    assert all(served), "hot was held back by a tenant that cannot be served"


def test_a_request_whose_executor_was_lost_waits_at_most_the_queue_bound_to_resume():
    w = World(limits=Limits(max_queue_s=3.0))
    req = w.request(max_new=50)
    w.step()
    assert req.status is Status.RUNNING
    w.core.on_executor_lost(w.executors[0])  # and no other executor takes it back
    assert req in w.core.placement.orphans
    w.now += 2.9
    w.core.expire()
    assert req.status is Status.QUEUED
    w.now += 0.2
    w.core.expire()
    error = error_of(w, req)
    assert isinstance(error, Unavailable) and "resumed" in str(error)


def test_a_load_from_staged_bytes_that_are_gone_gives_the_slot_back():
    """The executor dropped the staged bytes (its budget or their age): the load is ABORTED
    with the slot untouched, so the adapter that held it serves again, and the cold one is
    staged anew."""
    w = World(num_slots=1)
    hot = w.request(adapter="hot@1", max_new=1)
    w.run()
    assert w.finished(hot)
    ex = w.executors[0]
    w.request(adapter="cold@1", max_new=1)
    ((_, staged),) = w.stages
    w.stages.clear()
    w.core.on_stage_done(ex, staged, None)  # staged: it takes hot's slot (no one pins it)
    ((_, load),) = w.loads
    w.loads.clear()
    assert load.adapter == ref("cold@1") and load.is_from_staged
    w.core.on_load_done(ex, load, Aborted("not staged here any more"))
    slot = w.slots()[load.slot]
    assert slot.adapter == ref("hot@1") and slot.state is SlotState.READY
    again = w.request(adapter="hot@1", max_new=1)
    for _ in range(4):
        w.step()
    assert w.finished(again), "hot serves from the slot it never really left"
    assert [a for _, a in w.stages] == [ref("cold@1")], "cold is staged again"


def test_a_reservation_lapses_when_its_adapter_is_no_longer_staged():
    w = World(num_slots=1)
    hot = w.request(adapter="hot@1", max_new=50)
    w.complete_loads()
    w.step()  # hot runs: its slot is pinned
    cold = w.request(tenant="t2", adapter="cold@1", max_new=1)
    w.complete_loads()  # cold staged; no slot can take it while hot runs
    w.step()
    (slot,) = w.slots()
    assert slot.reserved_for == ref("cold@1"), "a slot drains for the staged adapter"
    w.now += STAGED_TTL_S + 1  # its staged bytes dropped (the executor keeps them that long)
    w.core.expire()
    assert w.slots()[0].reserved_for is None and hot.status is Status.RUNNING
    assert cold.status is Status.QUEUED


def test_a_reservation_ends_when_its_adapter_is_placed_in_another_slot():
    """A slot reserved for z while z loaded into another slot (one that came free first) must not
    stay reserved: it would take no admission for the adapter it holds and never be evicted, for
    as long as requests for z keep coming (a stall the simulator found with no fault at all)."""
    w = World(num_blocks=200, block_size=4, num_slots=2,
              limits=Limits(max_num_seqs=4, max_batched_tokens=64, fairness_window=0.0))
    w.request("t1", "x@1", prompt_len=2, max_new=6)  # two short x: slot 0 pinned twice
    w.request("t1", "x@1", prompt_len=2, max_new=6)
    w.request("t2", "y@1", prompt_len=2, max_new=200)  # one long y: slot 1 pinned once
    w.complete_loads()
    w.step()
    for _ in range(6):  # a cold z: staged, it reserves slot 1 (the fewest pins)
        w.request("t3", "z@1", prompt_len=2, max_new=30)
    w.step()
    w.complete_loads()
    w.step()
    assert [s.reserved_for for s in w.slots()] == [None, ref("z@1")]
    for _ in range(8):  # the x's end: slot 0 takes z
        w.step()
        w.complete_loads()
    slots = w.slots()
    assert slots[0].adapter == ref("z@1") and slots[1].adapter == ref("y@1")
    assert slots[1].reserved_for is None
    y2 = w.request("t4", "y@1", prompt_len=2, max_new=2)  # y is ready in slot 1
    for i in range(60):
        if i % 3 == 0:  # z stays wanted
            w.request("t3", "z@1", prompt_len=2, max_new=30)
        w.complete_loads()
        w.step()
    assert w.finished(y2)


def test_a_request_goes_only_to_an_executor_whose_kv_can_hold_it():
    """A pool's executors may differ in KV: a request that fits only the big one is never queued
    on the small one (there it could never start, and the requests behind it would wait too)."""
    w = World(num_executors=1, num_blocks=16, block_size=4)  # 64 tokens
    (small,) = w.executors
    big = w.core.add_executor("big", ExecutorShape(256, 4, 2))
    w.executors.append(big)
    w.request("t", prompt_len=200, max_new=8)  # busy: by load alone the small one would win
    long = w.request("t", prompt_len=200, max_new=8)
    short = [w.request("t", prompt_len=3, max_new=8) for _ in range(2)]
    assert long.executor is big and all(r.executor is small for r in short)
    for _ in range(20):
        w.step()
    assert all(w.finished(r) for r in short)
