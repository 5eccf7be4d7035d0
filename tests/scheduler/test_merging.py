"""Dedicated executors and merged adapters in the scheduler core (scheduler/merging.py): when the
merge and unmerge steps go out, where requests go meanwhile, what is refused, and the automatic
policy's hysteresis. No request is lost or fails because of a merge."""

import pytest

from common.errors import FailedPrecondition, InvalidArgument
from common.kv_layout import KVLayout
from protos import executor_pb2
from scheduler.executor_state import QuantizedBase
from scheduler.limits import Limits
from scheduler.request import Status
from scheduler.steps.sequence import Sample, Samples
from tests.scheduler.sched_world import World, ref

A, B = ref("a@1"), ref("b@1")


def plans(w: World, ex):
    """Plan and answer one step on ex (as World.step does for all); returns the plan."""
    plan = w.core.schedule(ex)
    w.core.on_step_done(ex, plan, Samples.of(
        Sample(r.seq.seq_id, 7, -0.1) for r in plan.rows if r.samples))
    return plan


def b_running(num_slots: int, max_new: int) -> tuple[World, list, object]:
    """Two executors; two requests for b running on one of them (returned)."""
    w = World(num_executors=2, num_slots=num_slots, limits=Limits(max_num_seqs=2))
    running = [w.request(adapter="b@1", max_new=max_new) for _ in range(2)]
    w.complete_loads()
    w.step()
    assert running[0].status is Status.RUNNING
    return w, running, running[0].executor


def test_a_merge_waits_for_other_adapters_to_finish_and_moves_their_queue():
    w, running_b, ex = b_running(num_slots=3, max_new=6)
    queued_b = [w.request(adapter="b@1", max_new=2) for _ in range(3)]
    w.core.merges.dedicate(ex, A, 2**20)
    assert w.core.merges.dedicated_to(ex) == A and all(r.executor is not ex for r in queued_b), \
        "its queue for other adapters moved"
    w.complete_loads()
    other = next(e for e in w.executors if e is not ex)
    seen_merge = False
    for _ in range(40):
        plan = plans(w, ex)
        if plan.merge_slot is not None:
            seen_merge = True
            assert not any(r.seq.request.ask.adapter != A for r in plan.rows)
            assert all(s.request.ask.adapter == A for s in w.running(ex).values()), \
                "merged only once nothing else runs"
            assert w.slots(ex)[plan.merge_slot].adapter == A
        plans(w, other)
        w.complete_loads()
    assert seen_merge and w.core.merges.state(ex).merged_slot is not None
    a_reqs = [w.request(adapter="a@1", max_new=3) for _ in range(3)]
    assert all(r.executor is ex for r in a_reqs), "its traffic goes to its merged executor"
    b_req = w.request(adapter="b@1", max_new=3)
    assert b_req.executor is not ex
    w.run()
    assert all(w.finished(r) for r in [*running_b, *queued_b, *a_reqs, b_req])


def test_unmerge_goes_out_in_the_next_step_and_the_slot_stays_pinned_until_answered():
    w = World(num_executors=2, num_slots=2)
    ex = w.operators.merge(A, 2**20, 1)[0]
    w.complete_loads()
    plan = plans(w, ex)
    assert plan.merge_slot is not None
    slot = w.core.merges.state(ex).merged_slot
    assert w.slots(ex)[slot].pins == 1
    w.operators.unmerge(A)
    assert w.core.merges.dedicated_to(ex) is None
    req = w.request(adapter="b@1", max_new=2)
    w.complete_loads()
    plan = w.core.schedule(ex)
    assert plan.unmerge and w.core.merges.state(ex).merged_slot is None \
        and w.slots(ex)[slot].pins >= 1, "pinned until answered"
    w.core.on_step_done(ex, plan, Samples.of(
        Sample(r.seq.seq_id, 7, -0.1) for r in plan.rows if r.samples))
    assert w.core.merges.state(ex).unmerging is None
    w.run()
    assert w.finished(req)


def test_the_last_executor_serving_everyone_is_never_merged():
    w = World(num_executors=1)
    with pytest.raises(FailedPrecondition, match="serving every adapter|one of those"):
        w.operators.merge(A, 2**20, 1)
    w = World(num_executors=2)
    with pytest.raises(FailedPrecondition, match="one of those must keep"):
        w.operators.merge(A, 2**20, 2)
    w.operators.merge(A, 2**20, 1)
    with pytest.raises(FailedPrecondition):
        w.operators.merge(B, 2**20, 1)


def test_losing_the_executor_that_serves_everyone_releases_the_merged_ones():
    w = World(num_executors=2)
    dedicated = w.operators.merge(A, 2**20, 1)[0]
    other = next(ex for ex in w.executors if ex is not dedicated)
    w.complete_loads()
    w.step()
    assert w.core.merges.state(dedicated).merged_slot is not None
    b_req = w.request(adapter="b@1", max_new=2)
    w.core.on_executor_lost(other)
    state = w.core.merges.state(dedicated)
    assert state.dedicated_to is None and state.unmerge_due
    w.complete_loads()
    assert plans(w, dedicated).unmerge
    w.run()
    assert w.finished(b_req) and b_req.executor is dedicated


def traffic_on(w: World, adapter: str, seconds: float) -> None:
    """A request for `adapter` every 0.1 s of w's clock, for `seconds`, each run as it comes."""
    end = w.now + seconds
    while w.now < end:
        w.request(adapter=adapter, max_new=2)
        w.complete_loads()
        w.step()  # (advances the clock 0.01 s)
        w.now += 0.09
        w.core.expire()


def test_traffic_merges_a_hot_adapter_after_a_window_and_unmerges_it_when_it_cools():
    limits = Limits(merge_share=0.6, unmerge_share=0.3, merge_window_s=5.0)
    w = World(num_executors=2, num_slots=3, limits=limits)

    def traffic(adapter: str, seconds: float) -> None:
        traffic_on(w, adapter, seconds)

    traffic("a@1", 3.0)
    dedicated = w.core.merges.dedicated_to
    assert not any(dedicated(ex) for ex in w.executors), "not before a full window"
    traffic("a@1", 3.0)
    assert [dedicated(ex) for ex in w.executors].count(A) == 1
    traffic("b@1", 3.0)
    assert [dedicated(ex) for ex in w.executors].count(A) == 1, "no change within a window"
    traffic("b@1", 4.0)
    assert A not in [dedicated(ex) for ex in w.executors], "cooled below unmerge_share"
    traffic("b@1", 6.0)
    assert [dedicated(ex) for ex in w.executors].count(B) == 1, "now b is the hot one"
    w.run()
    assert all(w.finished(r) for r in w.requests)


def test_executors_of_a_quantized_base_are_never_merged():
    """Folding B @ A into quantized weights would requantize them: neither an operator's merge
    nor the traffic policy dedicates such an executor, and its traffic runs on."""
    w = World(num_executors=3, num_slots=3, quantization="gptq (int4, group 128)",
              limits=Limits(merge_share=0.6, unmerge_share=0.3, merge_window_s=5.0))
    with pytest.raises(FailedPrecondition, match=r"quantized base \(gptq \(int4, group 128\)\)"):
        w.operators.merge(A, 2**20, 1)
    with pytest.raises(FailedPrecondition, match="would requantize"):
        w.core.merges.dedicate(w.executors[0], A, 2**20)
    traffic_on(w, "a@1", 12.0)  # (a's share is 1: two windows past merge_share)
    assert not any(w.core.merges.dedicated_to(ex) for ex in w.executors)
    w.run()
    assert all(w.finished(r) for r in w.requests)


def test_a_quantized_base_says_what_it_frees_in_kv_tokens_and_blocks():
    """From an executor's Info: 3 MiB freed, blocks of 64 KiB holding 16 tokens of 2 of its 8
    layers (window blocks): 48 blocks, each 4 tokens of every layer; a 16-bit base: None."""
    layout = KVLayout.of([4, None, 4, 4, None, 4, 4, 4])
    info = executor_pb2.InfoResponse(quantization="awq (int4, group 128)", num_kv_blocks=100,
                                     block_size=16, kv_cache_bytes=100 * 2**16,
                                     weight_bytes=2**20, dense_weight_bytes=4 * 2**20)
    assert layout.layers_per_block == 2
    assert QuantizedBase.of(info, layout) == QuantizedBase("awq (int4, group 128)", 3 * 2**20,
                                                           48 * 4, 48)
    info.quantization = ""
    assert QuantizedBase.of(info, layout) is None


def test_an_adapter_that_cannot_load_releases_its_dedicated_executor():
    w = World(num_executors=2)
    ex = w.operators.merge(A, 2**20, 1)[0]
    w.complete_loads(InvalidArgument("bad shapes"))
    assert w.core.merges.dedicated_to(ex) is None


def test_a_merge_with_no_traffic_brings_its_adapter_in_once_a_slot_frees():
    w, busy, ex = b_running(num_slots=1, max_new=5)
    w.core.merges.dedicate(ex, A, 2**20)  # its only slot is pinned by b's sequences
    for _ in range(20):
        w.complete_loads()
        w.step()
    assert all(w.finished(r) for r in busy)
    assert w.core.merges.merged_adapter(ex) == A, \
        "staged, loaded and merged with no request of its own waiting"
