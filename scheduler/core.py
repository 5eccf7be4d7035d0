"""The scheduler's policy: plain Python over plain data, no gRPC, no tensors.

The service (engine.py) and the simulator (sim/simulator.py) drive the very same object:
`submit`/`cancel` requests; per executor `schedule(ex)` -> StepPlan, then `on_step_done` with the
sampled tokens; `on_load_done`/`on_stage_done` when an adapter's load or staging ends; an
executor's life through `add_executor`, `on_executor_lost`, `drain`/`resume`, `leave`, `stop` and
`remove_executor`; the operators' `prewarm`, `evict`, `merge`, `unmerge`; `stats()`. The
callbacks it is given (start_load, start_unload, start_stage, warm_host, wake) are its only ways
out.

Scheduler owns small managers, each the only writer of its state (executor_state.py says which
part is whose), and does what spans them (a request admitted, preempted, finished):

    placement.py   Placement   where requests wait: routing, queues, orphans, work ahead
    residency.py   Residency   which adapter is in which slot, loads, staging, backoff, pins
    admission.py   Admission   who starts in a step (fair order, KV fit) and what tenants pay
    merging.py     Merges      executors dedicated to one adapter, merged into their weights
    step_builder.py            each executor's running sequences, plans and answers
                               (ex.steps: FastSteps, or ReferenceSteps, the plain definition)
    deadlines.py   Deadlines   when a waiting request gives up
    longrope.py                where a run ends and which cache key it takes on a longrope
                               model (Phi-3.5): a run that outgrows the switch is recomputed
"""

import functools
import itertools
import logging
import operator
import time
from collections.abc import Callable, Iterable, Mapping

from common.adapter_ref import AdapterRef
from common.detokenizer import Finish
from common.errors import (
    FailedPrecondition,
    LoraplexError,
    NotFound,
    Unavailable,
)
from scheduler.admission import Admission
from scheduler.deadlines import Deadlines, Due, expiry_error
from scheduler.executor_state import ExecutorState
from scheduler.fairness import FairnessWeights, FairShare
from scheduler.limits import Limits
from scheduler.merging import Merges
from scheduler.placement import Placement
from scheduler.request import ErrorEvent, FinishEvent, Request, Status
from scheduler.residency.residency import Residency
from scheduler.residency.slots import Slot
from scheduler.stats import PoolStats, TenantTotals, snapshot
from scheduler.steps.block_manager import BlockManager
from scheduler.steps.longrope import run_end
from scheduler.steps.prefix_cache import cache_key
from scheduler.steps.sequence import Samples, ScheduledRow, Sequence, StepPlan

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, executors: Iterable[ExecutorState], weights: FairnessWeights,
                 limits: Limits, start_load: Callable[[ExecutorState, Slot], None],
                 wake: Callable[[], None],
                 start_unload: Callable[..., None] = (
                     lambda ex, slot, adapter, done=None: done and done(True)),
                 clock: Callable[[], float] = time.monotonic,
                 warm_host: Callable[[AdapterRef], None] = lambda adapter: None,
                 start_stage: Callable[[ExecutorState, AdapterRef, int], None] = (
                     lambda ex, adapter, num_bytes: None)):
        self.limits, self.clock, self._wake = limits, clock, wake
        fair = FairShare(weights)
        self.residency = Residency(limits, clock, start_load, start_unload, start_stage,
                                   warm_host, charge_load=self._charge_load)
        self.placement = Placement(limits, fair, self.residency, wake)
        self.admission = Admission(limits, fair, self.placement, self.residency, clock)
        self.merges = Merges(limits, self.placement, self.residency, wake)
        self.deadlines = Deadlines(limits.max_queue_s, limits.max_load_wait_s)
        self.totals: dict[str, TenantTotals] = {}  # per tenant, of its ended requests
        self._seq_ids = itertools.count(1)
        for ex in executors:
            self.add_executor(ex)

    @property
    def executors(self) -> list[ExecutorState]:
        return self.placement.executors

    @property
    def orphans(self) -> list[Request]:
        """Requests queued while no executor can take them."""
        return self.placement.orphans

    @property
    def fair(self) -> FairShare:
        return self.admission.fair

    def _charge_load(self, req: Request, ex: ExecutorState) -> None:
        self.admission.charge_load(req, ex)

    # ---- requests in and out ----------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request, or refuse it now: its tenant has max_queued_per_tenant waiting
        (RESOURCE_EXHAUSTED), or every slot of every executor is pinned by an operator
        (FAILED_PRECONDITION: its adapter could never load)."""
        req.arrival = req.queued_since = self.clock()
        self.admission.check_backlog(req.tenant)
        if req.adapter:
            self.placement.check_placeable(req.adapter)
        if self.limits.prefix_cache != "off":
            req.cache_key = cache_key(self.limits.prefix_cache, req.tenant, req.adapter,
                                      req.cache_salt)
        self.deadlines.add(req)
        self.placement.route(req)
        log.debug("request %s (tenant %s, %s): queued", req.trace_id, req.tenant,
                  req.adapter or "base model")
        self._wake()

    def cancel(self, req: Request) -> None:
        """Forget a request whose client went away; frees whatever it held."""
        if req.status is Status.QUEUED:
            self.placement.dequeue(req)
        elif req.status is Status.RUNNING:
            ex = req.executor
            self._release(ex, next(s for s in ex.running.values() if s.request is req))
        self._end(req)
        self._wake()

    def expire(self) -> None:
        """Drop the waiting requests whose time is up (see deadlines.py); wake the executors
        when an adapter's load may be tried again. The engine calls this on a clock tick."""
        now = self.clock()
        self.merges.tick(now)
        for req, due in self.deadlines.due(now):
            if due is Due.LOAD_BOUND and not self._has_waited_for_its_fetch(req, now):
                continue
            self._fail(req, expiry_error(req, due, now, self.limits, self.placement.expected_wait))
        for ex in self.executors:
            if self.residency.expire(ex, now):
                self._wake()

    def _has_waited_for_its_fetch(self, req: Request, now: float) -> bool:
        """Whether queued req has waited max_load_wait_s for its adapter's fetch onto its
        executor; if not, it is looked at again when it would have."""
        bound = self.limits.max_load_wait_s
        since = (self.residency.fetching_since(req.executor, req.adapter)
                 if req.executor is not None else None)
        if since is None:  # nothing on its way for it now (it waits for a slot, say)
            self.deadlines.recheck(req, now + bound)
            return False
        start = max(since, req.queued_since)
        if now - start < bound:
            self.deadlines.recheck(req, start + bound)
            return False
        return True

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self, ex: ExecutorState) -> StepPlan:
        """The next step of `ex` (step_builder.py: its running sequences' rows, then admissions
        in fair order), and the merge or unmerge it carries."""
        admit = functools.partial(self._admit, ex) if ex.is_admitting else _admit_nobody
        plan = ex.steps.plan(ex.blocks, self.limits.max_batched_tokens, admit,
                             functools.partial(self._make_room, ex))
        self.placement.computed(ex, plan.num_tokens)  # (the next plan may follow at once)
        plan.unmerge = self.merges.unmerge_now(ex)
        plan.merge_slot = self.merges.merge_now(ex)
        return plan

    def on_step_done(self, ex: ExecutorState, plan: StepPlan, samples: Samples,
                     step_seconds: float = 0.0) -> None:
        """The answer to `plan`, the oldest step in flight on `ex`: its sampled tokens."""
        ex.steps_since_up += bool(plan.rows)  # (a step that only frees sequences computes nothing)
        ex.counters.steps_run += bool(plan.rows)
        ex.rates.observe_step(plan.num_tokens, step_seconds)
        ex.steps.answered(plan.step)
        ex.blocks.settle(ex.steps.steps_answered)
        self.merges.on_step_done(ex, plan)
        self.residency.unpin_answered(ex)  # (the step loop plans next: a freed slot is seen then)
        now = self.clock()
        self.merges.observe(plan, now)
        seqs = list(map(ex.running.get, samples.seq_ids))
        token_ids, logprobs = list(samples.token_ids), samples.logprobs  # (read more than once)
        if None in seqs:  # cancelled, preempted or finished while the step ran
            kept = list(map(operator.is_not, seqs, itertools.repeat(None)))
            seqs = list(itertools.compress(seqs, kept))
            token_ids = list(itertools.compress(token_ids, kept))
            logprobs = list(itertools.compress(logprobs, kept))
        self.admission.charge_samples(seqs)
        ex.steps.take(ex.blocks, seqs, token_ids, logprobs, now,
                      functools.partial(self._finish, ex),
                      functools.partial(self._outgrown, ex), samples.extras)

    def has_work(self, ex: ExecutorState) -> bool:
        return bool(ex.running) or (ex.is_admitting and len(ex.queue) > 0)

    def _admit(self, ex: ExecutorState, budget: int) -> list[ScheduledRow]:
        return self.admission.admit(ex, budget, functools.partial(self._start, ex))

    def _start(self, ex: ExecutorState, req: Request, tokens: list[int], hits: list[int],
               budget: int) -> ScheduledRow:
        """Run req on ex, its first blocks `hits` found in the prefix cache: its first row."""
        seq_id = next(self._seq_ids)
        table = ex.blocks.start(seq_id, hits, len(tokens))
        self.placement.start(ex, req, len(hits) * ex.blocks.block_size)
        slot = ex.slots.find(req.adapter) if req.adapter else None
        row = ex.steps.start(seq_id, req, slot, tokens, table, len(hits), ex.blocks, budget,
                             run_end(req, len(tokens), ex.rope_switch_len))
        if slot is not None:
            self.residency.pin(ex, slot, req)
        self.admission.charge_admitted(req, row.seq.num_cached)
        req.status = Status.RUNNING
        req.admitted_at = req.admitted_at or self.clock()
        return row

    def _make_room(self, ex: ExecutorState, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the most-served tenants' latest sequences until `seq` can hold `num_tokens`;
        False if `seq` itself had to go."""
        if self.residency.make_kv_room(ex, lambda: ex.blocks.can_grow(seq.seq_id, num_tokens),
                                       wanted_too=True):
            return True  # (pages of adapters nothing runs went back to KV)
        while not ex.blocks.can_grow(seq.seq_id, num_tokens):
            victim = self.admission.victim(ex)
            self._preempt(ex, victim)
            if victim is seq:
                return False
        return True

    # ---- adapter loads ----------------------------------------------------------------------
    def on_load_done(self, ex: ExecutorState, slot: Slot, adapter: AdapterRef,
                     error: LoraplexError | None, num_bytes: int = 0,
                     seconds: float = 0.0) -> None:
        try:
            failure = self.residency.on_load_done(ex, slot, adapter, error, num_bytes, seconds)
        except Exception:
            failure = self._fetch_broke(ex, adapter, "its load ended")
        if failure is not None:
            self._fail_waiting_for(ex, adapter, failure)
        self._wake()

    def on_stage_done(self, ex: ExecutorState, adapter: AdapterRef, error: LoraplexError | None,
                      num_bytes: int = 0, seconds: float = 0.0) -> None:
        """Its bytes are on ex's host (or could not be fetched): it may take a slot now."""
        try:
            failure = self.residency.on_stage_done(ex, adapter, error, num_bytes, seconds)
        except Exception:
            failure = self._fetch_broke(ex, adapter, "its staging ended")
        if failure is not None:
            self._fail_waiting_for(ex, adapter, failure)
        self._wake()

    def _fetch_broke(self, ex: ExecutorState, adapter: AdapterRef, when: str) -> LoraplexError:
        """A bug raised while bringing `adapter` onto ex: logged once, what was under way for it
        there given up whole (Residency.abandon); the error its waiting requests fail with."""
        log.exception("bringing %s onto %s failed when %s: this is a bug", adapter, ex.address,
                      when)
        self.residency.abandon(ex, adapter)
        return LoraplexError(f"bringing adapter {adapter} onto executor {ex.address} failed "
                             f"(an internal error, logged by the scheduler); this is a bug")

    def _fail_waiting_for(self, ex: ExecutorState, adapter: AdapterRef,
                          error: LoraplexError) -> None:
        """`adapter` can never load on ex: the requests queued there for it fail."""
        for req in [r for r in ex.queue if r.adapter == adapter]:
            self._fail(req, error)
        self.merges.on_fetch_failed(ex, adapter)

    # ---- an executor's life -----------------------------------------------------------------
    def add_executor(self, ex: ExecutorState) -> None:
        """A new (or reconnected) executor: up and admitting, it takes its place and the work that
        had nowhere to go."""
        ex.is_up, ex.is_draining = True, False
        self.placement.add(ex)
        self.placement.place_work()

    def remove_executor(self, ex: ExecutorState) -> None:
        """Forget an executor for good (it left the pool); its work moves to the others."""
        if ex.is_up:
            self.on_executor_lost(ex)
        self.placement.remove(ex)

    def on_executor_lost(self, ex: ExecutorState, error: LoraplexError | None = None) -> None:
        """Hand a dead executor's work to the others; its slots and blocks are gone. A running
        request under its max_executor_failures-th lost executor fails with `error`."""
        ex.is_up = False
        for seq in list(ex.running.values()):
            req = seq.request
            req.executor_failures += 1
            if req.executor_failures >= self.limits.max_executor_failures:
                self._release(ex, seq)
                self._end(req)
                failure = Unavailable(
                    f"{req.executor_failures} executors failed while running this request, the "
                    f"last {ex.address}: {error or 'it went away'}")
                log.info("request %s failed: %s", req.trace_id, failure)
                req.emit(ErrorEvent(failure))
        for seq in list(ex.running.values()):
            self._preempt(ex, seq)
        self.placement.evacuate(ex)
        ex.steps.forget_frees()
        self.residency.reset(ex)
        ex.blocks = BlockManager(ex.blocks.num_blocks, ex.blocks.block_size)
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

    # ---- operators --------------------------------------------------------------------------
    def find_executor(self, address: str) -> ExecutorState:
        for ex in self.executors:
            if ex.address == address:
                return ex
        known = ", ".join(ex.address for ex in self.executors) or "none"
        raise NotFound(f"no executor {address!r} in this pool (known: {known})")

    def prewarm(self, adapter: AdapterRef, adapter_bytes: int, num_executors: int,
                pin: bool, ranks: Mapping[str, int] | None = None) -> list[ExecutorState]:
        """Make `adapter` resident on `num_executors` executors (residency.py: prewarm)."""
        up = [ex for ex in self.placement.admitting() if ex.serves(adapter)]
        if not up:
            raise Unavailable(f"no executor is up and admitting work to pre-warm {adapter} on "
                              f"({len(self.executors)} known, all down or draining)")
        chosen = self.residency.prewarm(up, adapter, adapter_bytes, num_executors, pin, ranks)
        self._wake()
        return chosen

    def evict(self, adapter: AdapterRef, address: str = "") -> int:
        """Free the slots holding `adapter` (on one executor or all); refused while it runs."""
        targets = [self.find_executor(address)] if address else self.executors
        return self.residency.evict(targets, adapter)

    def merge(self, adapter: AdapterRef, adapter_bytes: int, num_executors: int,
              ranks: Mapping[str, int] | None = None) -> list[ExecutorState]:
        return self.merges.merge(adapter, adapter_bytes, num_executors, ranks)

    def unmerge(self, adapter: AdapterRef | None, address: str = "") -> list[str]:
        return self.merges.unmerge(adapter, address)

    def stats(self) -> PoolStats:
        return snapshot(self.executors, self.fair, self.totals)

    # ---- leaving the running set or a queue -------------------------------------------------
    def _preempt(self, ex: ExecutorState, seq: Sequence) -> None:
        """Give a running sequence's blocks back; its request recomputes later from all its
        tokens."""
        self._release(ex, seq)
        req = seq.request
        log.debug("request %s: preempted on %s", req.trace_id, ex.address)
        req.status = Status.QUEUED
        req.queued_since = self.clock()
        self.deadlines.requeued(req)
        self.placement.route(req, front=True)

    def _outgrown(self, ex: ExecutorState, seq: Sequence) -> None:
        """seq's run ended before its request: a longrope model's short run outgrew the switch
        (longrope.py). Its request runs again from all its tokens, with the long factors: back
        to the front of its queue, as after a preemption."""
        log.debug("request %s: past the longrope switch on %s, recomputed", seq.request.trace_id,
                  ex.address)
        self._preempt(ex, seq)

    def _release(self, ex: ExecutorState, seq: Sequence) -> None:
        ex.steps.release(seq)
        ex.blocks.free(seq.seq_id, seq.last_step if seq.is_sent else 0)
        self.placement.released(ex, seq)
        self.residency.unpin(ex, seq)

    def _finish(self, ex: ExecutorState, seq: Sequence, reason: Finish) -> None:
        self._release(ex, seq)
        seq.request.finish_reason = reason
        log.debug("request %s: finished (%s) on %s", seq.request.trace_id, reason.value,
                  ex.address)
        self._end(seq.request)
        seq.request.emit(FinishEvent(reason))

    def _fail(self, req: Request, error: LoraplexError) -> None:
        log.info("request %s failed: %s", req.trace_id, error)
        self.placement.dequeue(req)
        self._end(req)
        req.emit(ErrorEvent(error))

    def _end(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.totals.setdefault(req.tenant, TenantTotals()).add(req)


def _admit_nobody(budget: int) -> list[ScheduledRow]:
    return []
