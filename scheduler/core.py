"""The scheduler's policy: plain Python over plain data, no gRPC, no tensors.

The service (engine.py) and the simulator (sim/simulator.py) drive the very same object:
`submit`/`cancel` requests; per executor `schedule(ex)` -> StepPlan, then `on_step_done` with the
sampled tokens; `on_load_done`/`on_stage_done` when an adapter's load or staging ends; an
executor's life from `add_executor` (a fresh view of it, from its Info, at each connection) to
`on_executor_lost` or `remove_executor`; operators' commands go through operators.py. The
callbacks it is given (start_load, start_unload, start_stage, warm_host, wake) are its only ways
out. It owns small managers, each holding its state privately (docs/architecture.md: what each
owns and answers), and does what spans them: Placement, Residency, Admission, Merges, Deadlines,
and per executor a step builder (steps/) and its ExecutorState (its life, rates and blocks).
"""

import collections
import functools
import itertools
import logging
import operator
import time
from collections.abc import Callable

from common.adapter_ref import AdapterRef
from common.detokenizer import Finish
from common.errors import FailedPrecondition, InvalidArgument, LoraplexError, Unavailable
from common.grammar import Grammar
from scheduler.admission import Admission
from scheduler.deadlines import Deadlines, Due, expiry_error
from scheduler.executor_state import ExecutorShape, ExecutorState
from scheduler.fairness import FairnessWeights, FairShare
from scheduler.grammar_prep import GrammarPrep
from scheduler.limits import Limits
from scheduler.merging import Merges
from scheduler.placement import Placement
from scheduler.request import ErrorEvent, FinishEvent, Request, Status
from scheduler.residency.executor_residency import ExecutorResidency
from scheduler.residency.hooks import Hooks, Load
from scheduler.residency.residency import Residency
from scheduler.stats import TenantTotals
from scheduler.steps.block_manager import BlockManager, Hits
from scheduler.steps.fast_steps import FastSteps
from scheduler.steps.longrope import run_end
from scheduler.steps.prefix_cache import name_blocks
from scheduler.steps.sequence import Samples, ScheduledRow, Sequence, StepPlan
from scheduler.steps.step_builder import StepBuilder

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, weights: FairnessWeights, limits: Limits,
                 start_load: Callable[[ExecutorState, Load], None], wake: Callable[[], None],
                 start_unload: Callable[..., None] = (
                     lambda ex, slot, adapter, done=None: done and done(True)),
                 clock: Callable[[], float] = time.monotonic,
                 warm_host: Callable[[AdapterRef], None] = lambda adapter: None,
                 start_stage: Callable[[ExecutorState, AdapterRef, int], None] = (
                     lambda ex, adapter, num_bytes: None),
                 steps: Callable[[], StepBuilder] = FastSteps,
                 start_grammar: Callable[[ExecutorState, Grammar], None] | None = None):
        """`steps`: makes each executor's step builder (steps/step_builder.py).
        `start_grammar(ex, grammar)`: ask ex to compile a grammar ahead (grammar_prep.py;
        None: executors compile on their step path)."""
        self.limits, self.clock, self._wake = limits, clock, wake
        fair = FairShare(weights)
        # (What one manager asks of another made after it is bound late, through `self`.)
        self.residency = Residency(Hooks(
            limits, clock, start_load, start_unload, start_stage, warm_host,
            charge_load=lambda req, ex: self.admission.charge_load(req, ex),
            observe_load=lambda ex, num_bytes, seconds: ex.rates.observe_load(num_bytes, seconds),
            wanted=lambda ex: self.placement.wanted(ex),
            popularity=lambda ex, now: self.placement.popularity(ex, now),
            kv_ahead=lambda ex, adapter: self.placement.kv_ahead(ex, adapter, self._steps[ex])))
        self.grammars = GrammarPrep(start_grammar, wake)
        self.placement = Placement(limits, fair, self.residency, wake,
                                   lambda ex: self.merges.dedicated_to(ex), self.grammars)
        self.admission = Admission(limits, fair, self.placement, self.residency, clock,
                                   self.grammars)
        self.merges = Merges(limits, self.placement, self.residency, wake)
        self.deadlines = Deadlines(limits.max_queue_s, limits.max_load_wait_s)
        self.totals: dict[str, TenantTotals] = {}  # per tenant, of its ended requests
        self._new_steps = steps
        self._steps: dict[ExecutorState, StepBuilder] = {}  # per executor, its step builder
        self._steps_run: collections.Counter[str] = collections.Counter()  # see steps_run
        self.preemptions: collections.Counter[str] = collections.Counter()  # by address, ever
        self._seq_ids = itertools.count(1)

    @property
    def executors(self) -> list[ExecutorState]:
        return self.placement.executors

    @property
    def fair(self) -> FairShare:
        return self.admission.fair

    def steps_of(self, ex: ExecutorState) -> StepBuilder:
        """Ex's step builder: its running sequences, its plans."""
        return self._steps[ex]

    def steps_run(self, address: str) -> int:
        """Steps that computed something on the executor at `address`, in the process's life."""
        return self._steps_run[address]

    def wake(self) -> None:
        self._wake()

    # ---- requests in and out ----------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request, or refuse it now: its tenant has max_queued_per_tenant waiting
        (RESOURCE_EXHAUSTED), or every slot of every executor is pinned by an operator
        (FAILED_PRECONDITION: its adapter could never load)."""
        req.arrival = req.queued_since = self.clock()
        ask = req.ask
        self.admission.check_backlog(ask.tenant)
        if ask.adapter:
            self.placement.check_placeable(ask.adapter)
        name_blocks(req, self.limits.prefix_cache)
        self.deadlines.add(req)
        self.placement.route(req)
        log.debug("request %s (tenant %s, %s): queued", ask.request_id, ask.tenant,
                  ask.adapter or "base model")
        self._wake()

    def cancel(self, req: Request) -> None:
        """Forget a request whose client went away; frees whatever it held."""
        if req.status is Status.QUEUED:
            self.placement.dequeue(req)
        elif req.status is Status.RUNNING:
            ex = req.executor
            running = self._steps[ex].running.values()
            self._release(ex, next(s for s in running if s.request is req))
        self._end(req)
        self._wake()

    def expire(self) -> None:
        """Drop the waiting requests whose time is up (see deadlines.py); wake the executors
        when an adapter's load may be tried again. The engine calls this on a clock tick."""
        now = self.clock()
        self.merges.tick(now)
        for req, due in self.deadlines.due(now):
            part = None if req.executor is None else self.residency.get(req.executor)
            since = None if part is None else part.fetching_since(req.ask.adapter)
            if due is Due.LOAD_BOUND and not self.deadlines.has_waited_for_its_fetch(req, now,
                                                                                    since):
                continue
            failure = None if part is None else part.load_failure(req.ask.adapter)
            self._fail(req, expiry_error(req, due, now, self.limits, self.placement.expected_wait,
                                         failure.error if failure is not None else None))
        for ex in self.executors:
            if self.residency.of(ex).expire(now):
                self._wake()

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self, ex: ExecutorState) -> StepPlan:
        """The next step of `ex` (step_builder.py: its running sequences' rows, then admissions
        in fair order), and the merge or unmerge it carries."""
        steps = self._steps[ex]
        admit = functools.partial(self._admit, ex) if ex.is_admitting else _admit_nobody
        plan = steps.plan(ex.blocks, self.limits.max_batched_tokens, admit,
                          functools.partial(self._make_room, ex))
        self.placement.computed(ex, plan.num_tokens)  # (the next plan may follow at once)
        plan.unmerge = self.merges.unmerge_now(ex)
        plan.merge_slot = self.merges.merge_now(ex, steps)
        return plan

    def on_step_done(self, ex: ExecutorState, plan: StepPlan, samples: Samples,
                     step_seconds: float = 0.0) -> None:
        """The answer to `plan`, the oldest step in flight on `ex`: its sampled tokens."""
        steps = self._steps[ex]
        ex.steps_since_up += bool(plan.rows)  # (a step that only frees sequences computes nothing)
        self._steps_run[ex.address] += bool(plan.rows)
        ex.rates.observe_step(plan.num_tokens, step_seconds)
        steps.answered(plan.step)
        ex.blocks.settle(steps.steps_answered)
        self.merges.on_step_done(ex, plan)
        # (the step loop plans next: a slot freed here is seen then)
        self.residency.of(ex).unpin_answered(steps.steps_answered)
        now = self.clock()
        self.merges.observe(plan, now)
        seqs = list(map(steps.running.get, samples.seq_ids))
        token_ids, logprobs = list(samples.token_ids), samples.logprobs  # (read more than once)
        if None in seqs:  # cancelled, preempted or finished while the step ran
            kept = list(map(operator.is_not, seqs, itertools.repeat(None)))
            seqs = list(itertools.compress(seqs, kept))
            token_ids = list(itertools.compress(token_ids, kept))
            logprobs = list(itertools.compress(logprobs, kept))
        self.admission.charge_samples(seqs)
        steps.take(ex.blocks, seqs, token_ids, logprobs, now, functools.partial(self._finish, ex),
                   functools.partial(self._outgrown, ex), samples.extras)

    def has_work(self, ex: ExecutorState) -> bool:
        return bool(self._steps[ex].running) or (
            ex.is_admitting and self.placement.num_queued(ex) > 0)

    def _admit(self, ex: ExecutorState, budget: int) -> list[ScheduledRow]:
        start = functools.partial(self._start, ex)
        return self.admission.admit(ex, self._steps[ex].running, budget, start)

    def _start(self, ex: ExecutorState, req: Request, tokens: list[int], hits: list[int] | Hits,
               budget: int) -> ScheduledRow:
        """Run req on ex, its first blocks `hits` found in the prefix cache: its first row."""
        seq_id = next(self._seq_ids)
        first_end = min(len(tokens), len(hits) * ex.blocks.block_size + budget)
        table = ex.blocks.start(seq_id, hits, len(tokens), first_end)
        self.placement.start(ex, req, len(hits) * ex.blocks.block_size)
        slot = self.residency.of(ex).pin(req) if req.ask.adapter else -1
        row = self._steps[ex].start(seq_id, req, slot, tokens, table, len(hits), ex.blocks,
                                    budget, run_end(req, len(tokens), ex.rope_switch_len))
        self.admission.charge_admitted(req, row.seq.num_cached)
        req.status = Status.RUNNING
        req.admitted_at = req.admitted_at or self.clock()
        return row

    def _make_room(self, ex: ExecutorState, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the most-served tenants' latest sequences until `seq` can hold `num_tokens`;
        False if `seq` itself had to go."""
        if self.residency.of(ex).make_kv_room(
                lambda: ex.blocks.can_grow(seq.seq_id, num_tokens), wanted_too=True,
                reserved_too=True):
            return True  # (pages of adapters nothing runs went back to KV)
        running = self._steps[ex].running
        while not ex.blocks.can_grow(seq.seq_id, num_tokens):
            victim = self.admission.victim(running)
            self._preempt(ex, victim)
            if victim is seq:
                return False
        return True

    # ---- adapter loads ----------------------------------------------------------------------
    def on_load_done(self, ex: ExecutorState, load: Load, error: LoraplexError | None,
                     num_bytes: int = 0, seconds: float = 0.0) -> None:
        self._fetch_ended(ex, load.adapter, "its load ended",
                          lambda part: part.on_load_done(load, error, num_bytes, seconds))

    def on_stage_done(self, ex: ExecutorState, adapter: AdapterRef, error: LoraplexError | None,
                      num_bytes: int = 0, seconds: float = 0.0) -> None:
        """Its bytes are on ex's host (or could not be fetched): it may take a slot now."""
        self._fetch_ended(ex, adapter, "its staging ended",
                          lambda part: part.on_stage_done(adapter, error, num_bytes, seconds))

    def _fetch_ended(self, ex: ExecutorState, adapter: AdapterRef, when: str,
                     end: Callable[[ExecutorResidency], LoraplexError | None]) -> None:
        """`end` tells ex's residency; a failure not worth a retry fails its waiting requests."""
        part = self.residency.get(ex)  # (None: that view of ex was forgotten meanwhile)
        try:
            failure = None if part is None else end(part)
        except Exception:
            failure = self._fetch_broke(ex, adapter, when)
        if failure is not None:
            self._fail_waiting_for(ex, adapter, failure)
        self._wake()

    def _fetch_broke(self, ex: ExecutorState, adapter: AdapterRef, when: str) -> LoraplexError:
        """A bug raised while bringing `adapter` onto ex: logged once, what was under way for it
        there given up whole (ExecutorResidency.abandon); the error its waiting requests fail
        with."""
        log.exception("bringing %s onto %s failed when %s: this is a bug", adapter, ex.address,
                      when)
        self.residency.of(ex).abandon(adapter)
        return LoraplexError(f"bringing adapter {adapter} onto executor {ex.address} failed "
                             f"(an internal error, logged by the scheduler); this is a bug")

    def _fail_waiting_for(self, ex: ExecutorState, adapter: AdapterRef,
                          error: LoraplexError) -> None:
        """`adapter` can never load on ex: the requests queued there for it fail."""
        for req in [r for r in self.placement.queue(ex) if r.ask.adapter == adapter]:
            self._fail(req, error)
        self.merges.on_fetch_failed(ex, adapter)

    # ---- an executor's life -----------------------------------------------------------------
    def add_executor(self, address: str, shape: ExecutorShape,
                     is_leaving: bool = False) -> ExecutorState:
        """A new (or reconnected) executor: a fresh view of it from its Info's facts (a view of
        it from before is forgotten), up and admitting; it takes its place and the work that
        had nowhere to go. A departing executor stays departing (`is_leaving`)."""
        ex = ExecutorState.of(address, shape, is_leaving)
        self._steps[ex] = self._new_steps()
        self.residency.add(ex, shape)
        self.merges.add(ex)
        ex.is_up, ex.is_draining = True, False
        for old in self.placement.add(ex):
            self._forget(old)
        self.residency.restore_pins(ex)
        self.placement.place_work()
        return ex

    def remove_executor(self, ex: ExecutorState) -> None:
        """Forget an executor for good (it left the pool); its work moves to the others."""
        if ex.is_up:
            self.on_executor_lost(ex)
        self.placement.remove(ex)
        self._forget(ex)

    def on_grammar_prepared(self, ex: ExecutorState, grammar: Grammar,
                            error: LoraplexError | None = None) -> None:
        """ex compiled `grammar`, or failed to: one it refuses (INVALID_ARGUMENT) fails the
        requests queued there for it; after any other failure (a timeout, a restart) they
        start, and ex compiles it on its step path."""
        refused = isinstance(error, InvalidArgument)
        if refused:
            for req in [r for r in self.placement.queue(ex) if r.ask.sampling.grammar == grammar]:
                self._fail(req, error)
        self.grammars.prepared(ex, grammar, ready=not refused)

    def _forget(self, ex: ExecutorState) -> None:
        self.grammars.forget(ex)
        self.residency.remove(ex)
        self.merges.remove(ex)
        self._steps.pop(ex, None)

    def on_executor_lost(self, ex: ExecutorState, error: LoraplexError | None = None) -> None:
        """Hand a dead executor's work to the others; its slots and blocks are gone. A running
        request under its max_executor_failures-th lost executor fails with `error`."""
        ex.is_up = False
        steps = self._steps[ex]
        for seq in list(steps.running.values()):
            req = seq.request
            req.executor_failures += 1
            if req.executor_failures >= self.limits.max_executor_failures:
                self._release(ex, seq)
                self._end(req)
                failure = Unavailable(
                    f"{req.executor_failures} executors failed while running this request, the "
                    f"last {ex.address}: {error or 'it went away'}")
                log.info("request %s failed: %s", req.ask.request_id, failure)
                req.emit(ErrorEvent(failure))
        for seq in list(steps.running.values()):
            self._preempt(ex, seq)
        self.placement.evacuate(ex)
        steps.forget_frees()
        self.residency.of(ex).reset()
        self.grammars.forget(ex)  # (one that comes back has compiled nothing)
        ex.blocks = BlockManager(ex.blocks.num_blocks, ex.blocks.block_size, ex.blocks.layout)
        self.merges.forget(ex)
        self._wake()

    def drain(self, ex: ExecutorState) -> None:
        """Admit nothing new on ex; its running sequences finish, its queue moves elsewhere."""
        ex.is_draining = True
        self.placement.evacuate(ex)
        self.merges.keep_one_serving_everyone()
        self._wake()

    def leave(self, ex: ExecutorState) -> None:
        """Ex is gone from discovery: drain it (if up); it is forgotten once drained."""
        ex.is_leaving = True
        if ex.is_up:
            self.drain(ex)
        self._wake()

    def stop(self, ex: ExecutorState) -> None:
        """Ex is shutting down (its health said NOT_SERVING): drain it, release it once drained."""
        ex.is_stopping = True
        self.drain(ex)

    def resume(self, ex: ExecutorState) -> None:
        """Admit on a drained executor again: requests that had nowhere to go (every executor
        drained) go to it, queued ones that would start sooner there move. Refused for one that
        is down, leaving or stopping."""
        if not ex.can_resume:
            raise FailedPrecondition(f"executor {ex.address} is shutting down, down or leaving "
                                     "the pool; it cannot admit work")
        ex.is_draining = False
        self.placement.place_work()

    def is_drained(self, ex: ExecutorState) -> bool:
        return ex.is_draining and not (ex in self._steps and self._steps[ex].running)

    def is_retired(self, ex: ExecutorState) -> bool:
        """Drained and leaving or stopping: its step stream may close."""
        return self.is_drained(ex) and (ex.is_leaving or ex.is_stopping)

    # ---- leaving the running set or a queue -------------------------------------------------
    def _preempt(self, ex: ExecutorState, seq: Sequence) -> None:
        """Give a running sequence's blocks back; its request recomputes later from all its
        tokens."""
        self._release(ex, seq)
        req = seq.request
        self.preemptions[ex.address] += 1
        log.debug("request %s: preempted on %s", req.ask.request_id, ex.address)
        req.status = Status.QUEUED
        req.queued_since = self.clock()
        self.deadlines.requeued(req)
        self.placement.route(req, front=True)

    def _outgrown(self, ex: ExecutorState, seq: Sequence) -> None:
        """seq's run ended before its request: a longrope model's short run outgrew the switch
        (longrope.py). Its request runs again from all its tokens, with the long factors: back
        to the front of its queue, as after a preemption."""
        log.debug("request %s: past the longrope switch on %s, recomputed",
                  seq.request.ask.request_id, ex.address)
        self._preempt(ex, seq)

    def _release(self, ex: ExecutorState, seq: Sequence) -> None:
        """seq leaves ex's running set: its blocks and pin go once its last step is answered."""
        steps = self._steps[ex]
        last_step = steps.release(seq)  # (its counters are current from here on)
        ex.blocks.free(seq.seq_id, last_step)
        self.placement.released(ex, seq)
        if seq.slot_index >= 0:
            self.residency.of(ex).unpin(seq.seq_id, seq.slot_index, last_step,
                                        steps.steps_answered)

    def _finish(self, ex: ExecutorState, seq: Sequence, reason: Finish) -> None:
        self._release(ex, seq)
        req = seq.request
        req.finish_reason = reason
        log.debug("request %s: finished (%s) on %s", req.ask.request_id, reason.value,
                  ex.address)
        self._end(req)
        req.emit(FinishEvent(reason))

    def _fail(self, req: Request, error: LoraplexError) -> None:
        log.info("request %s failed: %s", req.ask.request_id, error)
        self.placement.dequeue(req)
        self._end(req)
        req.emit(ErrorEvent(error))

    def _end(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.totals.setdefault(req.ask.tenant, TenantTotals()).add(req)


def _admit_nobody(budget: int) -> list[ScheduledRow]:
    return []
