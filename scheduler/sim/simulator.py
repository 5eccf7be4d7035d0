"""A discrete-event simulator that drives the real scheduler core (scheduler/core.py) with a cost
model in place of executors: `loraplex simulate CONFIG`.

Events are arrivals, step completions and load completions, in time order. An idle executor with
work runs `schedule`; its step takes cost.step_base_s + per-token + per-distinct-adapter time;
every row that reaches the end of its tokens samples one token. Loads take latency + bytes /
bandwidth, one at a time per executor. The scheduler's clock is the simulated clock, and its
clock tick (`expire`: deadlines, backoffs, staged bytes' lifetime, merges) runs every TICK_S of
it, as the engine's does.
"""

import functools
import heapq
import itertools
import random
from collections import defaultdict
from dataclasses import dataclass, field, replace

from common.adapter_ref import AdapterRef
from common.detokenizer import OutputProcessor
from common.peft.modules import LORA_MODULES
from common.sampling import SamplingParams
from scheduler.core import Scheduler
from scheduler.executor_state import ExecutorShape, ExecutorState
from scheduler.fairness import FairnessWeights, spread_bound
from scheduler.request import Ask, ErrorEvent, FinishEvent, Request
from scheduler.residency.hooks import Load
from scheduler.sim.belady import belady_hits, lru_hits, pinned_belady_hits
from scheduler.sim.config import SimConfig
from scheduler.steps.sequence import NO_SAMPLES, Sample, Samples, StepPlan

ARRIVAL, STEP_DONE, LOAD_DONE, STAGE_DONE, TICK = 0, 1, 2, 3, 4
TICK_S = 0.1  # the core's clock tick (scheduler/engine.py's TICK_S)


@dataclass
class TenantResult:
    requests: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)  # arrival to first admission
    refused: int = 0  # ended with an error (max_queue_s, say) instead of finishing


@dataclass
class SimResult:
    seconds: float
    tenants: dict[str, TenantResult]
    adapter_admissions: int
    loads: int
    belady_hits: int  # clairvoyant eviction with plain slots (no pins): an upper bound
    pinned_belady_hits: int  # clairvoyant eviction under the same pins as the online policy
    lru_hits: int
    max_counter_gap: float
    fairness_bound: float
    unfinished: int


class Simulator:
    def __init__(self, config: SimConfig):
        self.cfg = c = config
        self.rng = random.Random(c.seed)
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()
        weights = dict(zip((f"t{i}" for i in range(c.tenants.count)), c.tenants.weights or ()))
        geometry = c.executors.geometry()
        page_bytes = geometry.page_elems * 2 if geometry else 0  # (bf16)
        shape = ExecutorShape(c.executors.kv_blocks, c.executors.block_size, c.executors.slots,
                              geometry, page_bytes)
        # Each adapter's rank: drawn once, apart from the arrivals (the same mix in every run).
        a = c.adapters
        self._ranks = (random.Random(c.seed + 1).choices(a.ranks, a.rank_shares, k=a.count)
                       if a.rank_shares else [a.ranks[k % len(a.ranks)] for k in range(a.count)])
        # Simulated prompts are placeholders ([1] * length): a prefix cache would find them all
        # alike. Prefix caching is not modelled.
        limits = replace(c.limits, prefix_cache="off")
        self.core = Scheduler(FairnessWeights(tenant_weights=weights), limits,
                              start_load=self._start_load, wake=lambda: None,
                              clock=lambda: self.now, start_stage=self._start_stage)
        self.executors = [self.core.add_executor(f"ex{i}", shape)
                          for i in range(c.executors.count)]
        self._requests: dict[int, Request] = {}  # submitted, not ended: by serial
        self._busy: set[int] = set()
        self._load_free_at = [0.0] * len(self.executors)
        self._adapter_weights = [1.0 / (k + 1) ** c.adapters.zipf_s
                                 for k in range(c.adapters.count)]
        self._cum = list(itertools.accumulate(self._adapter_weights))
        self._indices = range(len(self._cum))
        # Per executor, its adapter sequences' starts and ends in order: a pinned trace (belady.py).
        self.trace: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
        # seq_id -> adapter
        self._pinning: list[dict[int, AdapterRef]] = [{} for _ in self.executors]
        self.results: dict[str, TenantResult] = defaultdict(TenantResult)
        self.max_gap = 0.0
        self._live = 0

    # ---- workload ---------------------------------------------------------------------------
    def _adapter_bytes(self, k: int) -> int:
        return self._ranks[k] * self.cfg.adapters.bytes_per_rank

    def _adapter_ranks(self, k: int) -> dict[str, int] | None:
        """Its rank per module as its pages are planned: its own ("pages"), the largest of the mix
        ("padded", as vLLM and LoRAX size slots); None with fixed slots."""
        memory = self.cfg.executors.memory
        if memory == "slots":
            return None
        rank = self._ranks[k] if memory == "pages" else max(self.cfg.adapters.ranks)
        return dict.fromkeys(LORA_MODULES, rank)

    def _adapter(self) -> tuple[int, AdapterRef, int]:
        if self.rng.random() < self.cfg.adapters.heavy_share:
            k = 0
        else:
            k = self.rng.choices(self._indices, cum_weights=self._cum)[0]
        return k, AdapterRef(f"a{k}", 1), self._adapter_bytes(k)

    def _length(self, mean: int, cap: int) -> int:
        return max(1, min(cap, int(self.rng.expovariate(1.0 / mean)) + 1))

    def _next_arrival(self) -> float:
        """Poisson; or bursty: all traffic in bursts of period/burst_factor at burst_factor x
        rate."""
        a = self.cfg.arrivals
        if a.process == "poisson":
            return self.now + self.rng.expovariate(a.rate_per_s)
        on = a.burst_period_s / a.burst_factor
        t = self.now + self.rng.expovariate(a.rate_per_s * a.burst_factor)
        phase = self.now % a.burst_period_s
        if phase >= on or phase + (t - self.now) >= on:  # outside a burst: carry into the next one
            start = self.now - phase + a.burst_period_s
            t = start + (t - self.now) % on
        return t

    def _arrive(self, serial: int) -> None:
        k, adapter, num_bytes = self._adapter()
        tenant = f"t{k % self.cfg.tenants.count}"
        lengths = self.cfg.lengths
        prompt = (1,) * self._length(lengths.prompt_mean, lengths.prompt_max)
        max_new = self._length(lengths.output_mean, lengths.output_max)
        output = OutputProcessor(None, max_new_tokens=max_new)
        ask = Ask(tenant, adapter, num_bytes, prompt, SamplingParams(),
                  adapter_ranks=self._adapter_ranks(k))
        req = self._requests[serial] = Request(serial, ask, output,
                                               functools.partial(self._on_event, serial))
        self._live += 1
        self.core.submit(req)

    def _on_event(self, serial: int, event) -> None:
        req = self._requests[serial]
        r = self.results[req.ask.tenant]
        if isinstance(event, FinishEvent):
            del self._requests[serial]
            r.requests += 1
            r.tokens += req.output.num_tokens
            r.ttft.append(req.first_token_at - req.arrival)
            r.latency.append(self.now - req.arrival)
            r.wait.append(req.admitted_at - req.arrival)
            self._live -= 1
        elif isinstance(event, ErrorEvent):
            del self._requests[serial]
            r.refused += 1
            self._live -= 1

    # ---- executors --------------------------------------------------------------------------
    def _start_load(self, ex: ExecutorState, load: Load) -> None:
        """A load fetches the bytes (load latency + bytes / bandwidth, one fetch at a time per
        executor) unless they are staged already: then it only copies (taken as free)."""
        num_bytes = load.num_bytes
        seconds = 0.0 if load.is_from_staged else self._fetch(ex, num_bytes)
        self._push(self.now + seconds, LOAD_DONE, (ex, load, num_bytes, seconds))

    def _start_stage(self, ex: ExecutorState, adapter, num_bytes: int) -> None:
        seconds = self._fetch(ex, num_bytes)
        self._push(self.now + seconds, STAGE_DONE, (ex, adapter, None, num_bytes, seconds))

    def _fetch(self, ex: ExecutorState, num_bytes: int) -> float:
        """Seconds until a fetch of `num_bytes` started now ends (fetches queue per executor)."""
        i = self.executors.index(ex)
        seconds = self.cfg.cost.load_latency_s + num_bytes / self.cfg.cost.load_bytes_per_s
        start = max(self.now, self._load_free_at[i])
        self._load_free_at[i] = start + seconds
        return start + seconds - self.now

    def _try_steps(self) -> None:
        for i, ex in enumerate(self.executors):
            if i in self._busy or not self.core.has_work(ex):
                continue
            plan = self.core.schedule(ex)
            self._record_ends(i)  # preempted ones
            started = {seq.seq_id for seq in plan.new}
            for row in plan.rows:
                seq, adapter = row.seq, row.seq.request.ask.adapter
                if seq.seq_id in started and adapter:
                    self.trace[ex.address].append(("+", adapter, seq.seq_id))
                    self._pinning[i][seq.seq_id] = adapter
            if not plan:
                if plan.needs_sending:  # a merge, an unmerge or frees only: answered at once
                    self.core.on_step_done(ex, plan, NO_SAMPLES, 0.0)
                continue
            seconds = self._step_seconds(ex, plan)
            self._busy.add(i)
            self._push(self.now + seconds, STEP_DONE, (i, plan, seconds))

    def _step_seconds(self, ex: ExecutorState, plan: StepPlan) -> float:
        """The cost model's time for a step; an adapter merged into ex costs no LoRA work."""
        c = self.cfg.cost
        merged = self.core.merges.merged_adapter(ex)
        lora_rows = [row for row in plan.rows
                     if row.seq.request.ask.adapter and row.seq.request.ask.adapter != merged]
        adapters = {row.seq.request.ask.adapter for row in lora_rows}
        return (c.step_base_s + c.step_per_token_s * plan.num_tokens
                + c.step_per_adapter_s * len(adapters)
                + c.step_per_lora_token_s * sum(row.num_tokens for row in lora_rows))

    def _step_done(self, i: int, plan: StepPlan, seconds: float) -> None:
        self._busy.discard(i)
        samples = [Sample(row.seq.seq_id, 7, 0.0) for row in plan.rows if row.samples]
        self.core.on_step_done(self.executors[i], plan, Samples.of(samples), seconds)
        self._record_ends(i)

    def _record_ends(self, i: int) -> None:
        """Trace the ends of executor i's sequences that left its running set."""
        ex, pinning = self.executors[i], self._pinning[i]
        running = self.core.steps_of(ex).running
        for seq_id in [s for s in pinning if s not in running]:
            self.trace[ex.address].append(("-", pinning.pop(seq_id), seq_id))

    def _push(self, when: float, kind: int, payload) -> None:
        heapq.heappush(self._events, (when, next(self._order), kind, payload))

    def _sample_fairness(self) -> None:
        backlogged = [self.core.fair.counter(t) for t in self.core.fair.backlog]
        if len(backlogged) > 1:
            self.max_gap = max(self.max_gap, max(backlogged) - min(backlogged))

    # ---- run --------------------------------------------------------------------------------
    def run(self) -> SimResult:
        n = self.cfg.num_requests
        self._push(self._next_arrival(), ARRIVAL, 0)
        self._push(TICK_S, TICK, None)
        handled = 0
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == ARRIVAL:
                self._arrive(payload)
                if payload + 1 < n:
                    self._push(self._next_arrival(), ARRIVAL, payload + 1)
            elif kind == STEP_DONE:
                self._step_done(*payload)
            elif kind == STAGE_DONE:
                self.core.on_stage_done(*payload)
            elif kind == TICK:
                self.core.expire()
                if self._events:  # (while anything else is to happen)
                    self._push(self.now + TICK_S, TICK, None)
            else:
                ex, load, num_bytes, seconds = payload
                self.core.on_load_done(ex, load, None, num_bytes, seconds)
            self._try_steps()
            handled += 1
            if handled % 64 == 0:
                self._sample_fairness()
        return self._result()

    def _result(self) -> SimResult:
        cfg = self.cfg
        accesses = [[item for kind, item, _ in t if kind == "+"] for t in self.trace.values()]
        opt = sum(belady_hits(t, cfg.executors.slots) for t in accesses)
        pinned_opt = sum(pinned_belady_hits(t, cfg.executors.slots) for t in self.trace.values())
        lru = sum(lru_hits(t, cfg.executors.slots) for t in accesses)
        max_bytes = cfg.adapters.bytes_per_rank * max(cfg.adapters.ranks)
        max_load_tokens = max(ex.rates.load_seconds(max_bytes) * ex.rates.tokens_per_second
                              for ex in self.executors)
        # R: one tenant's running sequences on every executor, each up to the longest output.
        running_output = cfg.limits.max_num_seqs * cfg.executors.count * cfg.lengths.output_max
        bound = spread_bound(self.core.fair.weights, cfg.limits.fairness_window,
                             cfg.lengths.prompt_max, max_load_tokens, running_output)
        return SimResult(self.now, dict(self.results), sum(map(len, accesses)),
                         sum(self.core.residency.of(ex).counters().loads
                             for ex in self.executors), opt,
                         pinned_opt, lru,
                         self.max_gap, bound, self._live)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def format_report(cfg: SimConfig, r: SimResult) -> str:
    """A readable table of what the simulation measured."""
    total = sum(t.requests for t in r.tenants.values())
    tokens = sum(t.tokens for t in r.tenants.values())
    hit = 1 - r.loads / max(r.adapter_admissions, 1)
    opt = r.belady_hits / max(r.adapter_admissions, 1)
    pinned_opt = r.pinned_belady_hits / max(r.adapter_admissions, 1)
    online_vs_pinned = hit / pinned_opt if pinned_opt else float("nan")
    lines = [
        f"simulated {total:,} requests ({r.unfinished} unfinished) in {r.seconds:,.1f} s of model "
        f"time: {total / r.seconds:,.1f} req/s, {tokens / r.seconds:,.0f} output tokens/s",
        f"{cfg.adapters.count} adapters (Zipf {cfg.adapters.zipf_s}), {cfg.executors.count} "
        f"executors x {cfg.executors.slots} slots, {cfg.arrivals.process} arrivals at "
        f"{cfg.arrivals.rate_per_s:g}/s",
        f"adapter memory: {cfg.executors.memory}" + (
            "" if cfg.executors.memory == "slots" else
            f", in the {cfg.executors.kv_blocks:,} blocks of each executor with its KV"),
        "",
        f"{'tenant':8s}{'requests':>10s}{'tokens/s':>10s}{'TTFT p50':>10s}{'TTFT p99':>10s}"
        f"{'lat p50':>10s}{'lat p99':>10s}",
    ]
    for name in sorted(r.tenants, key=lambda t: int(t[1:])):
        t = r.tenants[name]
        lines.append(f"{name:8s}{t.requests:10,d}{t.tokens / r.seconds:10,.0f}"
                     f"{_pct(t.ttft, 50):9.3f}s{_pct(t.ttft, 99):9.3f}s"
                     f"{_pct(t.latency, 50):9.3f}s{_pct(t.latency, 99):9.3f}s")
    waits = [w for t in r.tenants.values() for w in t.wait]
    refused = sum(t.refused for t in r.tenants.values())
    lines += [
        "",
        f"wait for admission: p50 {_pct(waits, 50):.3f}s, p99 {_pct(waits, 99):.3f}s, longest "
        f"{max(waits, default=float('nan')):.3f}s; {refused:,} requests refused",
        f"GPU adapter hit rate: {hit:.1%} ({r.loads:,} loads for {r.adapter_admissions:,} "
        "adapter admissions)",
        f"Belady (clairvoyant eviction) on the same per-executor traces, with the same pins: "
        f"{pinned_opt:.1%} (online / optimal = {online_vs_pinned:.3f})",
        f"  without pins (slots never held by running sequences, unreachable): {opt:.1%} "
        f"({hit / opt if opt else float('nan'):.3f}); plain LRU without pins: "
        f"{r.lru_hits / max(r.adapter_admissions, 1):.1%}",
        f"largest virtual-counter gap between backlogged tenants: {r.max_counter_gap:,.0f} "
        f"token-equivalents (bound: window {cfg.limits.fairness_window:,.0f} + one admission "
        f"+ running output = {r.fairness_bound:,.0f})",
    ]
    return "\n".join(lines)
