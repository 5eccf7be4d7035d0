"""The fast step builder (scheduler/steps/fast_steps.py: the decode cohort, samples taken as
columns) makes exactly the reference builder's plans (scheduler/steps/reference_steps.py: every
sequence and sample one by one), given the same answers: over random arrivals (prompts sharing
prefixes, the base model and adapters, requests streaming to token sinks and emitting events),
finishes on EOS, stop tokens and length, cancels, preemption when KV runs short, executor loss,
and up to two steps in flight, on a longrope model too (runs recomputed past its switch). Two
worlds are driven in lockstep by the same events; every plan must be the same (rows, blocks,
frees, new sequences) and every request must get the same tokens and finish.

The stand-in executor of test_pipelined_steps checks every row reads its own context; its
answers are given in sequence order (an executor may order its samples as it likes; a builder's
rows of one adapter may come in another order, which would otherwise change which blocks free
first)."""

import collections
import random

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from common.adapter_pages import plan_pages
from common.detokenizer import OutputProcessor
from common.kv_layout import KVLayout
from common.sampling import SamplingParams
from scheduler.limits import Limits
from scheduler.request import Ask, Request, Status
from scheduler.sim.invariants import check_invariants
from scheduler.steps.fast_steps import FastSteps
from scheduler.steps.reference_steps import ReferenceSteps
from scheduler.steps.sequence import Samples
from tests.scheduler.sched_world import World, ref
from tests.scheduler.test_pipelined_steps import EOS, STOP, Sink, StandInExecutor, outcome
from tests.scheduler.test_scheduler_properties import GEOMETRY

ADAPTERS = [None, ref("a@1"), ref("b@1"), ref("c@1")]
RANKS = {ref("a@1"): {"q_proj": 2, "v_proj": 2}, ref("b@1"): {"q_proj": 8},
         ref("c@1"): {"down_proj": 4}}  # (their pages, where executors keep adapters in pages)
PREFIXES = [[], [5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 20]]


class Twin:
    """One world, its executor's stand-in and the plans in flight."""

    def __init__(self, steps, num_blocks: int, limits: Limits, block_size: int = 4,
                 geometry=None, switch: int = 0, layout=None) -> None:
        self.w = World(num_blocks=num_blocks, block_size=block_size, num_slots=2,
                       limits=limits, steps=steps, geometry=geometry, rope_switch_len=switch,
                       kv_layout=layout)
        self.ex = self.w.executors[0]
        self.layout = layout
        self.executor = StandInExecutor(block_size, switch, layout)
        self.in_flight: collections.deque = collections.deque()
        self.sinks = [Sink(), Sink()]

    def arrive(self, tenant: str, adapter, prompt: list[int], max_new: int, sink: int,
               stop_ids: tuple[int, ...] = (EOS, STOP)) -> None:
        w = self.w
        rid = next(w._ids)
        w.events[rid] = []
        ask = Ask(tenant, adapter, 2**20, tuple(prompt), SamplingParams(),
                  adapter_ranks=RANKS.get(adapter))
        req = Request(rid, ask,
                      OutputProcessor(None, max_new_tokens=max_new, stop_token_ids=stop_ids),
                      w.events[rid].append, sink=self.sinks[sink] if sink >= 0 else None,
                      sink_id=rid if sink >= 0 else 0)
        w.core.submit(req)
        w.requests.append(req)

    def plan(self) -> tuple | None:
        """Plan a step if fewer than the pipeline's depth are in flight: the plan, comparable."""
        if len(self.in_flight) >= self.w.core.limits.pipeline_depth:
            return None
        plan = self.w.core.schedule(self.ex)
        slots = [row.slot_index for row in plan.rows]
        assert slots == sorted(slots), "rows must be sorted by adapter slot"
        if plan.needs_sending:  # (as the engine: an empty plan is not sent, nor answered)
            self.in_flight.append(plan)
        self._loads_started()
        return (plan.step, sorted(plan.freed), [seq.seq_id for seq in plan.new],
                sorted((row.slot_index, row.seq_id, row.num_tokens, repr(row.new_block_ids),
                        row.samples) for row in plan.rows),
                plan.num_tokens, plan.num_samples)

    def answer(self) -> None:
        if not self.in_flight:
            return
        plan = self.in_flight.popleft()
        samples = sorted(self.executor.run(plan))  # (in sequence order)
        self.w.core.on_step_done(self.ex, plan, Samples.of(samples))
        check_invariants(self.w.core, self.w.requests)

    def loads(self) -> None:
        self.w.complete_loads(loaded=lambda slot, adapter: self.executor.slots.update(
            {slot: adapter}))
        self._loads_started()

    def cancel(self, k: int) -> None:
        live = [r for r in self.w.requests if r.status is not Status.FINISHED]
        if live:
            self.w.core.cancel(live[k % len(live)])

    def lose(self) -> None:
        """The executor is lost with its steps in flight, and comes back empty."""
        self.w.core.on_executor_lost(self.ex)
        self.in_flight.clear()
        self.executor = StandInExecutor(self.ex.blocks.block_size, self.executor.switch,
                                        self.layout)
        self.ex = self.w.executors[0] = self.w.core.add_executor(self.ex.address, self.w.shape)
        check_invariants(self.w.core, self.w.requests)

    def outcomes(self) -> dict[int, tuple]:
        return {r.serial: outcome(self.w, r) for r in self.w.requests}

    def _loads_started(self) -> None:
        for _, load in self.w.loads:  # (a load writes its slot from the moment it starts)
            self.executor.slots[load.slot] = None


def random_events(rng: random.Random, num_events: int) -> list[tuple]:
    """A workload: arrivals among plans and answers (most events), loads ending, cancels and now
    and then the executor lost."""
    kinds = ["arrive"] * 3 + ["plan"] * 6 + ["answer"] * 6 + ["loads"] * 2 + ["cancel"]
    events = []
    for _ in range(num_events):
        kind = "lose" if rng.random() < 0.01 else rng.choice(kinds)
        if kind == "arrive":
            tail = [rng.randint(2, 200) for _ in range(rng.randint(1, 14))]
            events.append((kind, rng.choice(["t0", "t1", "t2"]), rng.randrange(len(ADAPTERS)),
                           rng.randrange(len(PREFIXES)), tail, rng.randint(1, 24),
                           rng.randint(-1, 1)))
        elif kind == "cancel":
            events.append((kind, rng.randrange(100)))
        else:
            events.append((kind,))
    return events


# KV layouts (common/kv_layout.py): one kind, the whole context; every layer of a 6-key window;
# a global layer beside three of a 6-key window (3 blocks per token block of the window's)
LAYOUTS = [None, KVLayout.of([6, 6]), KVLayout.of([6, None, 6, 6])]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), num_blocks=st.integers(10, 40),
       geometry=st.sampled_from([None, GEOMETRY]), switch=st.sampled_from([0, 16]),
       layout=st.sampled_from(LAYOUTS),
       limits=st.builds(Limits, max_num_seqs=st.integers(1, 8),
                        max_batched_tokens=st.integers(1, 24), pipeline_depth=st.integers(1, 2),
                        fairness_window=st.sampled_from([0.0, 50.0]),
                        prefix_cache=st.sampled_from(["tenant", "pool", "off"])))
# (Once a deadlock: nothing running, a base request short of one block that c's pages would
# give, c's slot reserved for a, and a's load holding back KV for that request, ahead of a's
# oldest by a tie of arrival times: Placement.kv_ahead.)
@example(seed=2789, num_blocks=10, geometry=GEOMETRY, switch=16, layout=None,
         limits=Limits(max_num_seqs=3, max_batched_tokens=3, pipeline_depth=1,
                       fairness_window=0.0, prefix_cache="tenant"))
# (And: b's request short of one block beside b's own pages and a's, reserved for c.)
@example(seed=20, num_blocks=10, geometry=GEOMETRY, switch=0, layout=None,
         limits=Limits(max_num_seqs=1, max_batched_tokens=13, pipeline_depth=1,
                       fairness_window=0.0, prefix_cache="tenant"))
def test_the_fast_builder_makes_the_reference_builders_plans(seed, num_blocks, geometry, switch,
                                                             layout, limits):
    """(`switch`: a longrope model's, where runs end and are recomputed: longrope.py; `layout`:
    window blocks, which a window kind gives back as rows move on.)"""
    reference = Twin(ReferenceSteps, num_blocks, limits, geometry=geometry, switch=switch,
                     layout=layout)
    fast = Twin(FastSteps, num_blocks, limits, geometry=geometry, switch=switch, layout=layout)
    twins = (reference, fast)
    for kind, *args in random_events(random.Random(seed), 400):
        if kind == "arrive":
            tenant, adapter, prefix, tail, max_new, sink = args
            prompt = PREFIXES[prefix] + tail
            ranks = RANKS.get(ADAPTERS[adapter])
            pages = plan_pages(ranks, geometry).num_pages if geometry and ranks else 0
            most = fast.ex.blocks.most_blocks(len(prompt) + max_new, limits.max_batched_tokens)
            if most + pages <= num_blocks:  # (the service refuses more)
                for twin in twins:
                    twin.arrive(tenant, ADAPTERS[adapter], prompt, max_new, sink)
        elif kind == "plan":
            assert reference.plan() == fast.plan()
        else:
            for twin in twins:
                getattr(twin, kind)(*args)
    for _ in range(2000):  # drain: every request ends, the same way in both
        if not any(t.in_flight or t.w.core.has_work(t.ex) or t.w.loads or t.w.stages
                   for t in twins):
            break
        for twin in twins:
            twin.loads()
        assert reference.plan() == fast.plan()
        for twin in twins:
            twin.answer()
    else:
        raise AssertionError("work did not drain")
    assert reference.outcomes() == fast.outcomes()
    assert all(r.status is Status.FINISHED for r in fast.w.requests)


def test_steady_decode_is_planned_by_the_cohort_and_matches_the_reference():
    """The property test above would pass with a cohort that never forms: here most rows of a
    long steady decode are planned as the cohort's, and the plans still equal the reference's."""
    limits = Limits(max_num_seqs=16, max_batched_tokens=64, pipeline_depth=2)
    reference, fast = (Twin(kind, 400, limits, block_size=16)
                       for kind in (ReferenceSteps, FastSteps))
    for i in range(16):
        for twin in (reference, fast):
            twin.arrive(f"t{i % 3}", ADAPTERS[i % 4], PREFIXES[i % 3] + [100 + i], 60,
                        i % 3 - 1, stop_ids=())
    member_rows = rows = 0
    for _ in range(150):
        for twin in (reference, fast):
            twin.loads()
        plan = fast.plan()
        assert reference.plan() == plan
        rows += len(plan[3]) if plan else 0
        member_rows += len(fast.w.core.steps_of(fast.ex).cohort) if plan else 0
        for twin in (reference, fast):
            twin.answer()
    assert rows and member_rows > 0.7 * rows, (member_rows, rows)
    assert reference.outcomes() == fast.outcomes()


def test_a_sample_the_long_way_and_as_columns_reach_a_sink_alike():
    """Of a request streaming to a sink, the fast builder takes most samples as columns (no
    on_sample), the reference none: the sink gets the same tokens."""
    limits = Limits(max_num_seqs=4, max_batched_tokens=32)
    twins = [Twin(kind, 100, limits) for kind in (ReferenceSteps, FastSteps)]
    for twin in twins:
        twin.arrive("t0", None, [3, 4, 5], 40, 0)
        for _ in range(60):
            twin.plan()
            twin.answer()
    tokens = [twin.sinks[0].tokens for twin in twins]
    assert tokens[0] == tokens[1] and len(next(iter(tokens[0].values()))) > 10
