"""The decode cohort (scheduler/steps/cohort.py): it changes no plan (the same rows, step after
step, as the reference builder planning every sequence one by one), and in steady decode it plans
most rows."""

import collections

from scheduler.limits import Limits
from scheduler.sim.invariants import check_invariants
from scheduler.steps.fast_steps import FastSteps
from scheduler.steps.reference_steps import ReferenceSteps
from scheduler.steps.sequence import Sample, Samples
from tests.scheduler.sched_world import World


def pipelined(w: World, steps: int, arrivals: dict[int, list[tuple[str, int, int]]]) -> list:
    """Run w's one executor with two steps in flight for `steps` steps, requests (tenant, prompt
    length, max new tokens) arriving at the steps named; every plan as (rows, freed, new)."""
    ex = w.executors[0]
    in_flight: collections.deque = collections.deque()
    plans = []
    for step in range(steps):
        for tenant, prompt_len, max_new in arrivals.get(step, ()):
            w.request(tenant=tenant, prompt_len=prompt_len, max_new=max_new)
        plan = w.core.schedule(ex)
        slots = [row.seq.slot_index for row in plan.rows]
        assert slots == sorted(slots), "rows must be sorted by adapter slot"
        plans.append((sorted((row.seq.seq_id, row.num_tokens, tuple(row.new_block_ids),
                              row.samples) for row in plan.rows),
                      sorted(plan.freed), [seq.seq_id for seq in plan.new]))
        in_flight.append(plan)
        if len(in_flight) == 2:
            plan = in_flight.popleft()
            w.core.on_step_done(ex, plan, Samples.of(
                Sample(row.seq.seq_id, 7, -0.1) for row in plan.rows if row.samples))
            check_invariants(w.core, w.requests)
    return plans


ARRIVALS = {0: [("a", 3, 40), ("b", 9, 25), ("a", 1, 60), ("c", 14, 7)],
            5: [("b", 6, 30), ("c", 2, 2)], 11: [("a", 21, 18)], 30: [("c", 5, 50)]}


def test_the_cohort_changes_no_plan():
    def run(steps) -> list:
        w = World(num_blocks=400, block_size=4, steps=steps,
                  limits=Limits(max_num_seqs=16, max_batched_tokens=4096, pipeline_depth=2))
        return pipelined(w, 120, ARRIVALS)

    assert run(FastSteps) == run(ReferenceSteps)  # (everyone planned one by one)


def test_the_cohort_changes_no_plan_when_its_members_are_preempted():
    """A budget of a few tokens and KV blocks short enough to preempt: a member preempted while
    its step is planned gives its budget token back, as planning one by one does."""
    def run(steps) -> list:
        w = World(num_blocks=7, block_size=4, steps=steps, limits=Limits(
            max_num_seqs=4, max_batched_tokens=3, fairness_window=0.0, prefix_cache="off"))
        plans, schedule = [], w.core.schedule

        def traced(ex):
            plan = schedule(ex)
            plans.append((sorted((r.seq_id, r.num_tokens) for r in plan.rows), plan.freed))
            return plan
        w.core.schedule = traced
        w.request("a", prompt_len=1, max_new=30)
        w.request("b", prompt_len=4, max_new=30)
        for step in range(30):
            if step == 9:
                w.request("z", prompt_len=1, max_new=3)
            w.step()
        return plans

    assert run(FastSteps) == run(ReferenceSteps)


def test_the_cohort_plans_most_rows_of_steady_decode():
    w = World(num_blocks=4096, block_size=16,
              limits=Limits(max_num_seqs=32, max_batched_tokens=4096, pipeline_depth=2))
    ex = w.executors[0]
    for i in range(32):
        w.request(tenant=f"t{i % 4}", prompt_len=3 + i, max_new=500)
    pipelined(w, 20, {})  # (prefills, then decode)
    rows = members = 0
    for _ in range(100):
        plan = w.core.schedule(ex)
        rows += len(plan.rows)
        members += sum(row.seq.cohort is w.core.steps_of(ex).cohort
                       and row.seq.joined_at < plan.step
                       for row in plan.rows)  # (planned as members: not joining just now)
        w.core.on_step_done(ex, plan, Samples.of(
            Sample(row.seq.seq_id, 7, -0.1) for row in plan.rows if row.samples))
    assert rows == 32 * 100
    assert members > 0.75 * rows, (members, rows)


def test_steps_whose_budget_holds_fewer_rows_than_run_complete_every_request():
    w = World(num_blocks=400, block_size=4,
              limits=Limits(max_num_seqs=16, max_batched_tokens=8, pipeline_depth=2))
    plans = pipelined(w, 400, {0: [(f"t{i % 3}", 2, 12 + i) for i in range(12)],
                               20: [("t0", 3, 9)] * 4})
    assert all(sum(n for _, n, _, _ in rows) <= 8 for rows, _, _ in plans)
    assert [len(r.output.token_ids) for r in w.requests] == [12 + i for i in range(12)] + [9] * 4
    assert not w.running() and not w.core.steps_of(w.executors[0]).cohort.members


def test_a_sequence_out_of_the_cohort_is_planned_before_a_newer_prompt():
    """Decoding sequences are older than a prompt that arrives later, and take their one token
    of a step's budget first, also while out of the cohort (at each block boundary): a long
    prompt's chunks never hold an older sequence's decode back."""
    w = World(num_blocks=400, block_size=4,
              limits=Limits(max_num_seqs=4, max_batched_tokens=8, pipeline_depth=2))
    plans = pipelined(w, 40, {0: [("a", 2, 60)], 6: [("b", 100, 2)]})
    long_prompt = [rows for rows, _, _ in plans if any(row[0] == 2 for row in rows)]
    assert len(long_prompt) >= 14  # (100 tokens, at most 7 a step beside the decode row)
    assert all(any(row[0] == 1 for row in rows) for rows in long_prompt)
