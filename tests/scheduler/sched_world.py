"""A synchronous harness around the scheduler core: executors answer every plan at once with one
token per sequence that reached the end of its tokens; loads finish when told to. The invariant
checker runs after every step. Executors plan with the fast step builder unless `steps` says
otherwise (step_builder.py). `w.operators` takes operators' commands (scheduler/operators.py)."""

from common.adapter_ref import AdapterRef
from common.detokenizer import OutputProcessor
from common.sampling import SamplingParams
from scheduler.core import Scheduler
from scheduler.executor_state import ExecutorShape, QuantizedBase
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.operators import Operators
from scheduler.request import Ask, FinishEvent, Request
from scheduler.sim.invariants import check_invariants
from scheduler.steps.fast_steps import FastSteps
from scheduler.steps.sequence import Sample, Samples

DEFAULT_RANKS = {"q_proj": 8, "v_proj": 8}


def ref(text: str) -> AdapterRef:
    return AdapterRef.parse(text)


class World:
    """One or more executors driven synchronously; loads complete when `complete_loads` runs."""

    def __init__(self, num_executors=1, num_blocks=64, block_size=4, num_slots=2,
                 limits=Limits(), weights=FairnessWeights(), steps=FastSteps, geometry=None,
                 rope_switch_len=0, kv_layout=None, quantization="", prepare_grammars=False):
        """`geometry`: the executors keep adapters in pages of their KV blocks (a
        common.adapter_pages.PageGeometry); None: in fixed slots beside them.
        `rope_switch_len`: their model's longrope switch (scheduler/steps/longrope.py; 0: none).
        `kv_layout`: their KV's kinds of layers (common/kv_layout.py; None: one, the whole).
        `quantization`: their base's, in words ("": 16-bit).
        `prepare_grammars`: constrained requests wait for their grammar's compile, asked in
        `grammars_asked` (the core is told with on_grammar_prepared); else none waits."""
        self.loads: list = []  # (executor, its Load) of every load under way
        self.unloads: list = []  # (executor, slot index, adapter) of every UnloadAdapter
        self.stages: list = []  # adapters being staged (fetched ahead of taking a slot)
        self.warmed: list[AdapterRef] = []  # adapters the core asked a store to bring into RAM
        self.grammars_asked: list = []  # (executor, grammar) of every PrepareGrammar
        self.now = 0.0
        self.core = Scheduler(
            weights, limits, start_load=lambda ex, load: self._load(ex, load),
            wake=lambda: None, clock=lambda: self.now, warm_host=self.warmed.append,
            start_unload=lambda *args, **kwargs: self._unload(*args, **kwargs),
            start_stage=lambda ex, adapter, num_bytes: self.stages.append((ex, adapter)),
            steps=steps, start_grammar=(lambda ex, grammar: self.grammars_asked.append(
                (ex, grammar))) if prepare_grammars else None)
        self.operators = Operators(self.core)
        self.shape = ExecutorShape(num_blocks, block_size, num_slots, geometry,
                                   rope_switch_len=rope_switch_len, kv_layout=kv_layout,
                                   quantized=QuantizedBase(quantization) if quantization
                                   else None)
        self.executors = [self.core.add_executor(f"ex{i}", self.shape)
                          for i in range(num_executors)]
        self.events: dict[int, list] = {}
        self.requests: list[Request] = []
        self._ids = iter(range(1, 10**6))

    def _load(self, ex, load) -> None:
        self.loads.append((ex, load))

    def _unload(self, ex, slot: int, adapter: AdapterRef, done=None) -> None:
        self.unloads.append((ex, slot, adapter))
        if done is not None:
            done(True)  # (answered at once)

    def request(self, tenant="t", adapter: str | AdapterRef = "", prompt_len=5,
                max_new=4, ranks=None, deadline=None,
                sampling: SamplingParams = SamplingParams()) -> Request:
        """A request for `adapter` ("name@version", "" = the base model), submitted; `ranks`:
        its adapter's per-module ranks (its pages), by default rank 8 on q_proj and v_proj;
        `deadline`: the client's, on the world's clock."""
        rid = next(self._ids)
        if isinstance(adapter, str):
            adapter = ref(adapter) if adapter else None
        self.events[rid] = []
        ask = Ask(tenant, adapter, 2**20, tuple(range(1, prompt_len + 1)), sampling,
                  adapter_ranks=ranks or DEFAULT_RANKS, deadline=deadline)
        req = Request(rid, ask, OutputProcessor(None, max_new_tokens=max_new),
                      self.events[rid].append)
        self.core.submit(req)
        self.requests.append(req)
        return req

    def complete_loads(self, error=None, loaded=None) -> None:
        """End every staging and load under way (with `error`, failed); loads that stagings
        start are completed too, unless `error`. `loaded(slot index, adapter)` is told of each
        load before the core is."""
        while self.stages or self.loads:
            stages, self.stages = self.stages, []
            for ex, adapter in stages:
                self.core.on_stage_done(ex, adapter, error)
            loads, self.loads = self.loads, []
            for ex, load in loads:
                if loaded is not None:
                    loaded(load.slot, load.adapter)
                self.core.on_load_done(ex, load, error)
            if error is not None:
                break

    def step(self) -> None:
        self.now += 0.01
        for ex in self.executors:
            plan = self.core.schedule(ex)
            slots = [row.seq.slot_index for row in plan.rows]
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

    # ---- what the tests look at (each manager asked) ----------------------------------------
    def slots(self, ex=None) -> tuple:
        """Ex's slots (the first executor's by default), as Stats reports them."""
        return self.core.residency.of(ex or self.executors[0]).slot_stats()

    def slot(self, adapter: str | AdapterRef, ex=None):
        """The slot holding or loading `adapter` on ex, as Stats reports it; None: none."""
        adapter = ref(adapter) if isinstance(adapter, str) else adapter
        return next((s for s in self.slots(ex) if s.adapter == adapter
                     and s.state.value in ("loading", "ready")), None)

    def running(self, ex=None) -> dict:
        """Ex's running sequences (seq_id -> seq)."""
        return self.core.steps_of(ex or self.executors[0]).running

    def queue(self, ex=None):
        return self.core.placement.queue(ex or self.executors[0])

    def finished(self, req: Request) -> bool:
        return any(isinstance(e, FinishEvent) for e in self.events[req.serial])
