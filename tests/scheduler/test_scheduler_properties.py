"""Property tests of the scheduler's invariants under random arrivals, cancellations, load failures,
executor loss, drains and returns, merges and unmerges (hypothesis drives the sequence of
events). Every prompt of the
harness starts 1, 2, 3, ...: with the prefix cache on, requests of the same tenant (or of any
tenant, in pool scope) and adapter share blocks all along, and the invariants check that no block
is ever shared across cache keys, that reference counts match the tables and that every block is
free, cached or referenced."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.adapter_pages import PageGeometry, plan_pages
from common.errors import FailedPrecondition, InvalidArgument, Unavailable
from scheduler.limits import Limits
from scheduler.request import ErrorEvent, FinishEvent, Status
from scheduler.sim.invariants import check_invariants
from tests.scheduler.sched_world import World, ref

ADAPTERS = ["", "a@1", "b@1", "c@1", "d@1", "e@1"]
RANKS = {"a@1": {"q_proj": 1, "v_proj": 1}, "b@1": {"q_proj": 8}, "c@1": {"v_proj": 4},
         "d@1": {"q_proj": 2, "down_proj": 2}, "e@1": {"q_proj": 16, "v_proj": 16}}
GEOMETRY = PageGeometry(num_layers=2, region_elems=1024, module_shapes={
    "q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256),
    "gate_proj": (256, 688), "up_proj": (256, 688), "down_proj": (688, 256)})

arrive = st.tuples(st.just("arrive"), st.sampled_from(["t0", "t1", "t2"]),
                   st.sampled_from(ADAPTERS), st.integers(1, 24), st.integers(1, 8))
event = st.one_of(
    arrive,
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("loads"), st.sampled_from(["ok", "ok", "ok", "unavailable", "invalid"])),
    st.tuples(st.just("cancel"), st.integers(0, 10**6)),
    st.tuples(st.just("lose"), st.integers(0, 1)),
    st.tuples(st.just("return"), st.integers(0, 1)),
    st.tuples(st.just("drain"), st.integers(0, 1)),
    st.tuples(st.just("merge"), st.sampled_from(ADAPTERS[1:])),
    st.tuples(st.just("unmerge"), st.sampled_from(ADAPTERS[1:])),
)


def back_again(w: World, i: int) -> None:
    """Executor i admits again: a drained one resumes, a lost one reconnects (a fresh view)."""
    ex = w.executors[i]
    if ex.is_up:
        w.core.resume(ex)
    else:
        w.executors[i] = w.core.add_executor(ex.address, w.shape)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(event, min_size=1, max_size=60),
       slots=st.integers(1, 3), blocks=st.integers(8, 40),
       geometry=st.sampled_from([None, GEOMETRY]),
       limits=st.builds(Limits, max_num_seqs=st.integers(1, 6),
                        max_batched_tokens=st.integers(1, 32),
                        max_adapters_per_batch=st.integers(0, 3),
                        fairness_window=st.sampled_from([0.0, 50.0]),
                        affinity_max_wait_s=st.sampled_from([0.0, 0.05]),
                        prefix_cache=st.sampled_from(["tenant", "pool", "off"])))
def test_invariants_hold_and_no_request_is_lost(events, slots, blocks, geometry, limits):
    """With `geometry`, adapters take pages of the KV blocks (adapter_memory.py), of ranks that
    differ by adapter."""
    w = World(num_executors=2, num_blocks=blocks, block_size=4, num_slots=slots, limits=limits,
              geometry=geometry)
    for kind, *args in events:
        if kind == "arrive":
            tenant, adapter, prompt_len, max_new = args
            ranks = RANKS.get(adapter)
            pages = plan_pages(ranks, geometry).num_pages if geometry and ranks else 0
            if -(-(prompt_len + max_new + 4) // 4) + pages <= blocks:  # (the service refuses
                w.request(tenant, adapter, prompt_len, max_new, ranks)  # longer requests)
        elif kind == "step":
            for _ in range(args[0]):
                w.step()
        elif kind == "loads":
            error = {"ok": None, "unavailable": Unavailable("store down"),
                     "invalid": InvalidArgument("bad shapes")}[args[0]]
            w.complete_loads(error)
        elif kind == "cancel" and w.requests:
            req = w.requests[args[0] % len(w.requests)]
            if req.status is not Status.FINISHED:
                w.core.cancel(req)
        elif kind == "lose":
            ex = w.executors[args[0]]
            if ex.is_up:
                w.core.on_executor_lost(ex)
        elif kind == "return":  # up and admitting again
            back_again(w, args[0])
        elif kind == "drain":
            w.core.drain(w.executors[args[0]])
        elif kind == "merge":
            try:
                w.operators.merge(ref(args[0]), 2**20, 1, RANKS[args[0]])
            except (FailedPrecondition, Unavailable):
                pass  # the last executor serving everyone, or none up
        elif kind == "unmerge":
            w.operators.unmerge(ref(args[0]))
        check_invariants(w.core, w.requests)

    for i in range(len(w.executors)):  # bring every executor back, then everything must finish
        back_again(w, i)
    w.run(max_steps=3000)
    for req in w.requests:
        outcome = [e for e in w.events[req.serial] if isinstance(e, (FinishEvent, ErrorEvent))]
        assert req.status is Status.FINISHED
        assert len(outcome) == 1 or (not outcome and req.finish_reason is None), \
            "finished once, or cancelled"
    for ex in w.executors:
        assert ex.blocks.num_free + ex.blocks.num_pages == ex.blocks.num_blocks
        assert not w.running(ex) and len(w.queue(ex)) == 0
        merged = w.core.merges.state(ex).merged_slot
        assert all(slot.pins == (i == merged) for i, slot in enumerate(w.slots(ex)))
