"""A synchronous harness around the scheduler core: executors answer every plan at once with one
token per sequence that reached the end of its tokens; loads finish when told to. The invariant
checker runs after every step. Executors plan with the fast step builder unless `steps` says
otherwise (step_builder.py)."""

from common.adapter_ref import AdapterRef
from common.detokenizer import OutputProcessor
from common.sampling import SamplingParams
from scheduler.core import Scheduler
from scheduler.executor_state import ExecutorState
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.request import FinishEvent, Request
from scheduler.residency.slots import SlotTable
from scheduler.sim.invariants import check_invariants
from scheduler.steps.block_manager import BlockManager
from scheduler.steps.fast_steps import FastSteps
from scheduler.steps.sequence import Sample, Samples

DEFAULT_RANKS = {"q_proj": 8, "v_proj": 8}


def ref(text: str) -> AdapterRef:
    return AdapterRef.parse(text)


class World:
    """One or more executors driven synchronously; loads complete when `complete_loads` runs."""

    def __init__(self, num_executors=1, num_blocks=64, block_size=4, num_slots=2,
                 limits=Limits(), weights=FairnessWeights(), steps=FastSteps, geometry=None,
                 rope_switch_len=0):
        """`geometry`: the executors keep adapters in pages of their KV blocks (a
        common.adapter_pages.PageGeometry); None: in fixed slots beside them.
        `rope_switch_len`: their model's longrope switch (scheduler/steps/longrope.py; 0: none)."""
        self.loads: list = []
        self.unloads: list = []  # (executor, slot index, adapter) of every UnloadAdapter
        self.stages: list = []  # adapters being staged (fetched ahead of taking a slot)
        self.warmed: list[AdapterRef] = []  # adapters the core asked a store to bring into RAM
        self.executors = [ExecutorState(f"ex{i}", BlockManager(num_blocks, block_size),
                                        SlotTable(num_slots), steps(), geometry=geometry,
                                        rope_switch_len=rope_switch_len)
                          for i in range(num_executors)]
        self.now = 0.0
        self.core = Scheduler(
            self.executors, weights, limits,
            start_load=lambda ex, slot: self.loads.append((ex, slot, slot.adapter)),
            wake=lambda: None, clock=lambda: self.now, warm_host=self.warmed.append,
            start_unload=self._unload,
            start_stage=lambda ex, adapter, num_bytes: self.stages.append((ex, adapter)))
        self.events: dict[int, list] = {}
        self.requests: list[Request] = []
        self._ids = iter(range(1, 10**6))

    def _unload(self, ex, slot: int, adapter: AdapterRef, done=None) -> None:
        self.unloads.append((ex, slot, adapter))
        if done is not None:
            done(True)  # (answered at once)

    def request(self, tenant="t", adapter: str | AdapterRef = "", prompt_len=5,
                max_new=4, ranks=None) -> Request:
        """A request for `adapter` ("name@version", "" = the base model), submitted; `ranks`:
        its adapter's per-module ranks (its pages), by default rank 8 on q_proj and v_proj."""
        rid = next(self._ids)
        if isinstance(adapter, str):
            adapter = ref(adapter) if adapter else None
        self.events[rid] = []
        req = Request(rid, tenant, adapter, 2**20, list(range(1, prompt_len + 1)), SamplingParams(),
                      OutputProcessor(None, max_new_tokens=max_new), self.events[rid].append,
                      adapter_ranks=ranks or DEFAULT_RANKS)
        self.core.submit(req)
        self.requests.append(req)
        return req

    def complete_loads(self, error=None, loaded=None) -> None:
        """End every staging and load under way (with `error`, failed); loads that stagings
        start are completed too, unless `error`. `loaded(slot, adapter)` is told of each load
        before the core is."""
        while self.stages or self.loads:
            stages, self.stages = self.stages, []
            for ex, adapter in stages:
                self.core.on_stage_done(ex, adapter, error)
            loads, self.loads = self.loads, []
            for ex, slot, adapter in loads:
                if loaded is not None:
                    loaded(slot, adapter)
                self.core.on_load_done(ex, slot, adapter, error)
            if error is not None:
                break

    def step(self) -> None:
        self.now += 0.01
        for ex in self.executors:
            plan = self.core.schedule(ex)
            slots = [row.seq.slot.index if row.seq.slot else -1 for row in plan.rows]
            assert slots == sorted(slots), "rows must be sorted by adapter slot"
            samples = [Sample(row.seq.seq_id, 7, -0.1) for row in plan.rows if row.samples]
            self.core.on_step_done(ex, plan, Samples.of(samples))
            check_invariants(self.core, self.requests)

    def run(self, max_steps=500) -> None:
        for _ in range(max_steps):
            self.complete_loads()
            self.step()
            if not any(self.core.has_work(ex) for ex in self.executors) and not (
                    self.loads or self.stages):
                return
        raise AssertionError("work did not drain")

    def finished(self, req: Request) -> bool:
        return any(isinstance(e, FinishEvent) for e in self.events[req.request_id])
