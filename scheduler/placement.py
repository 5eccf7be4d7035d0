"""Where each request waits or runs: the state the scheduler core (core.py) is built on.

Placement holds the pool's executors, the requests that had nowhere to go (orphans), the tenants'
fair counters and the totals of ended requests, and the moves of a request between places:
routed to the executor where it would start soonest (routing.py) and queued there, its adapter
brought in (a slot claimed and loaded, or the store asked to warm it), moved when another executor
would start it sooner, preempted back into a queue, released, ended. ExecutorEvents
(executor_events.py) adds loads and an executor's life on top, Scheduler (core.py) the step and
admission.
"""

import itertools
import math
import time
from collections.abc import Callable, Iterable

from common.adapter_ref import AdapterRef
from common.errors import FailedPrecondition, LoraplexError, ResourceExhausted, retry_after
from scheduler.deadlines import Deadlines
from scheduler.executor_state import ExecutorState, Limits, Sequence
from scheduler.fairness import FairnessWeights, FairShare
from scheduler.merging import MergePolicy
from scheduler.request import ErrorEvent, Request, Status
from scheduler.routing import home, score
from scheduler.slots import Slot
from scheduler.stats import TenantTotals

# A merged executor wins its adapter's requests unless its expected wait is this much longer
# than another's: it runs them without LoRA work, a gain not worth a long queue.
MERGED_BIAS_S = 0.1


class Placement:
    def __init__(self, executors: Iterable[ExecutorState], weights: FairnessWeights,
                 limits: Limits, start_load: Callable[[ExecutorState, Slot], None],
                 wake: Callable[[], None],
                 start_unload: Callable[[ExecutorState, int, AdapterRef], None] = (
                     lambda ex, slot, adapter: None),
                 clock: Callable[[], float] = time.monotonic,
                 warm_host: Callable[[AdapterRef], None] = lambda adapter: None,
                 start_stage: Callable[[ExecutorState, AdapterRef, int], None] = (
                     lambda ex, adapter, num_bytes: None)):
        self.executors: list[ExecutorState] = []
        self.limits = limits
        self.fair = FairShare(weights)
        self.orphans: list[Request] = []  # queued while no executor can take work
        self.deadlines = Deadlines(limits.max_queue_s)
        self.totals: dict[str, TenantTotals] = {}  # per tenant, of its ended requests
        self.clock = clock
        self.merges = MergePolicy(limits)
        self._start_load, self._start_unload, self._wake = start_load, start_unload, wake
        self._warm_host, self._start_stage = warm_host, start_stage
        self._seq_ids = itertools.count(1)
        for ex in executors:
            self.add_executor(ex)

    # ---- executors joining ------------------------------------------------------------------
    def add_executor(self, ex: ExecutorState) -> None:
        """A new (or reconnected) executor: up and admitting, it takes its place and the work that
        had nowhere to go."""
        ex.is_up, ex.is_draining = True, False
        ex.popularity.half_life_s = self.limits.popularity_half_life_s
        self.executors = [e for e in self.executors if e.address != ex.address] + [ex]
        self._place_work()

    def _place_work(self) -> None:
        """Route the requests that had nowhere to go, and move queued ones to where they would
        start sooner now (an executor joined or admits again)."""
        orphans, self.orphans = self.orphans, []
        for req in orphans:
            self.fair.on_dequeue(req.tenant)
            self._route(req)
        self._rebalance()
        self._wake()

    # ---- routing ----------------------------------------------------------------------------
    def _route(self, req: Request, front: bool = False) -> None:
        ex = self._best_executor(req)
        self.fair.on_enqueue(req.tenant)
        if ex is None:
            req.executor = None
            self.orphans.append(req)
            return
        self._enqueue(ex, req, front)

    def _best_executor(self, req: Request) -> ExecutorState | None:
        """The executor where req would start soonest: its adapter's home (rendezvous hash) wins
        ties by home_bias_s, an executor it is merged into (merging.py) by MERGED_BIAS_S. Only
        executors whose KV can hold it whole (a pool's executors may differ)."""
        candidates = [ex for ex in self.executors
                      if ex.is_admitting and ex.serves(req.adapter) and ex.can_hold(req)]
        if not candidates:
            return None
        if any(ex.dedicated_to is not None for ex in candidates):
            return min(candidates, key=lambda e: self._score(e, req, False) + MERGED_BIAS_S * (
                e.dedicated_to is None))
        addresses = [e.address for e in candidates]
        home_address = home(req.adapter, addresses) if req.adapter else ""
        return min(candidates, key=lambda e: self._score(e, req, e.address != home_address))

    def _enqueue(self, ex: ExecutorState, req: Request, front: bool = False) -> None:
        req.executor = ex
        if req.adapter and not front:
            ex.popularity.hit(req.adapter, req.arrival)
        ex.queue.push(req, front)
        ex.work_tokens += req.work_left
        if (req.adapter and ex.slots.find(req.adapter) is None and not self._place(ex, req)
                and ex.slots.staged(req.adapter) is None):
            # Not on its way (its loads back off): have the store bring it into RAM meanwhile,
            # so that the next try does not wait on S3.
            self._warm_host(req.adapter)

    def move(self, req: Request) -> None:
        """Route a queued request again (its executor no longer takes it)."""
        self._dequeue(req)
        self._route(req)

    def place_work(self) -> None:
        self._place_work()

    def _rebalance(self) -> None:
        """Move queued requests to where they would start sooner now."""
        queued = (r for ex in self.executors for r in ex.queue)
        for req in sorted(queued, key=lambda r: r.arrival):
            best = self._best_executor(req)
            if best is not None and best is not req.executor:
                req.executor.queue.remove(req)
                req.executor.work_tokens -= req.work_left
                self._enqueue(best, req)

    def _score(self, ex: ExecutorState, req: Request, is_away: bool) -> float:
        resident = not req.adapter or ex.slots.find(req.adapter) is not None
        can_place = resident or ex.slots.can_place(req.adapter, ex.queue.demand)
        return score(ex.work_tokens, ex.rates, resident, can_place, req.adapter_bytes,
                     self.limits.slot_wait_s, self.limits.home_bias_s if is_away else 0.0)

    def _place(self, ex: ExecutorState, req: Request) -> bool:
        """Bring req's adapter onto ex ahead of its admission (prefetch), unless its last failed
        fetch is too recent (backoff); its tenant pays for the fetch it causes. True when a slot
        was claimed for it (see bring_in)."""
        failure = ex.load_failures.get(req.adapter)
        if failure is not None and failure.retry_at > self.clock():
            return False
        slots = ex.slots
        is_new = slots.staged(req.adapter) is None and slots.find(req.adapter) is None
        if is_new and not req.caused_load:  # (once per request, not per retry of a failed fetch)
            req.caused_load = True
            seconds = ex.rates.load_seconds(req.adapter_bytes)
            weight = self.fair.weights.load_weight
            self.fair.charge(req.tenant, weight * seconds * ex.rates.tokens_per_second)
        return self.bring_in(ex, req.adapter, req.adapter_bytes) is not None

    def bring_in(self, ex: ExecutorState, adapter: AdapterRef, num_bytes: int) -> Slot | None:
        """Start bringing `adapter` onto ex, stage before evict (slots.py): into an empty slot at
        once; into the slot of an adapter that may go only once its bytes are staged on ex's
        host, starting the staging when it is not. The slot claimed, if any."""
        slots = ex.slots
        staged = slots.staged(adapter)
        if slots.has_empty() or (staged is not None and staged.staged_at is not None
                                 and slots.can_place(adapter, ex.queue.demand)):
            return self.start_load_on(ex, adapter, num_bytes)
        if staged is None:
            slots.begin_stage(adapter, num_bytes)
            self._start_stage(ex, adapter, num_bytes)
        return None

    def start_load_on(self, ex: ExecutorState, adapter: AdapterRef, num_bytes: int) -> Slot:
        """Claim a slot of ex for `adapter` (of `num_bytes`) and start loading it there (caller
        checked there is one: an empty one, or its bytes are staged and can_place)."""
        now = self.clock()
        slot = ex.slots.place(adapter, ex.queue.demand, lambda a: ex.popularity.value(a, now),
                              num_bytes)
        ex.num_evictions += bool(slot.evicted)
        self._start_load(ex, slot)
        return slot

    def evict_slot(self, ex: ExecutorState, slot: Slot) -> None:
        adapter = slot.adapter
        ex.slots.clear(slot)
        self._start_unload(ex, slot.index, adapter)

    # ---- whether a request may wait, and how far ahead a tenant may get -------------------
    def _check_tenant_backlog(self, tenant: str) -> None:
        cap, queued = self.limits.max_queued_per_tenant, self.fair.backlog.get(tenant, 0)
        if cap and queued >= cap:
            wait = self._expected_wait()
            raise retry_after(ResourceExhausted(
                f"tenant {tenant!r} has {queued} requests waiting, the most this pool queues "
                f"for one tenant; retry in {wait:.0f}s"), wait)

    def _check_placeable(self, adapter: AdapterRef) -> None:
        admitting = [ex for ex in self.executors if ex.is_admitting]
        if admitting and all(ex.slots.find(adapter) is None and ex.slots.are_all_admin_pinned()
                             for ex in admitting):
            raise FailedPrecondition(
                f"every adapter slot of every executor is pinned by an operator, so {adapter} "
                "could never be loaded: evict a pinned adapter (Evict) or pre-warm this one")

    def _expected_wait(self) -> float:
        """Seconds the queued work takes the pool at its measured rate: a retry-after hint."""
        up = [ex for ex in self.executors if ex.is_admitting]
        rate = sum(ex.rates.tokens_per_second for ex in up)
        seconds = sum(ex.work_tokens for ex in up) / rate if rate else 60.0
        return min(60.0, max(1.0, seconds))

    def cancel(self, req: Request) -> None:
        """Forget a request whose client went away; frees whatever it held."""
        if req.status is Status.QUEUED:
            self._dequeue(req)
        elif req.status is Status.RUNNING:
            ex, seq = req.executor, self._sequence_of(req)
            self._release(ex, seq)
        self._end(req)
        self._wake()

    def _fairness_ceiling(self) -> float:
        """No tenant more than fairness_window ahead of the least-served backlogged tenant is
        admitted, except that a tenant whose oldest request waits for an adapter whose loads are
        failing (a store or S3 down: its loads back off) holds nobody back: it cannot be served
        whatever the others do, and the window would stall the pool for as long as the outage."""
        window = self.limits.fairness_window
        if not window:
            return math.inf
        if not any(ex.load_failures for ex in self.executors):
            return self.fair.min_backlogged() + window
        servable = [self.fair.counter(t) for ex in self.executors for t in ex.queue.tenants()
                    if not _waits_on_a_failing_load(ex, ex.queue.oldest(t))]
        servable += [self.fair.counter(r.tenant) for r in self.orphans]
        return min(servable) + window if servable else math.inf

    # ---- leaving a queue or the running set -------------------------------------------------
    def _preempt(self, ex: ExecutorState, seq: Sequence) -> None:
        """Give a running sequence's blocks back; its request recomputes later from all its
        tokens."""
        self._release(ex, seq)
        req = seq.request
        req.status = Status.QUEUED
        req.queued_since = self.clock()
        self.deadlines.requeued(req)
        req.work_left = seq.max_tokens  # (every token computed again)
        self._route(req, front=True)

    def _release(self, ex: ExecutorState, seq: Sequence) -> None:
        ex.release(seq)
        ex.blocks.free(seq.seq_id)
        ex.work_tokens -= seq.max_tokens - seq.num_computed  # (its work left)
        if seq.slot is not None:
            if ex.is_in_flight(seq):
                ex.unpin_later.append(seq)
            else:
                ex.slots.unpin(seq.slot)
        if seq.is_sent:
            ex.pending_frees.append(seq.seq_id)

    def _dequeue(self, req: Request) -> None:
        if req.executor is None:
            self.orphans.remove(req)
        else:
            req.executor.queue.remove(req)
            req.executor.work_tokens -= req.work_left
        self.fair.on_dequeue(req.tenant)

    def _end(self, req: Request) -> None:
        req.status = Status.FINISHED
        req.work_left = 0
        self.totals.setdefault(req.tenant, TenantTotals()).add(req)

    def _fail(self, req: Request, error: LoraplexError) -> None:
        self._dequeue(req)
        self._end(req)
        req.emit(ErrorEvent(error))

    def _sequence_of(self, req: Request) -> Sequence:
        return next(seq for seq in req.executor.running.values() if seq.request is req)

    def wake(self) -> None:
        self._wake()


def _waits_on_a_failing_load(ex: ExecutorState, req: Request | None) -> bool:
    """Its adapter's fetches on ex failed and none has succeeded since (a retry may be under
    way: it fails as long as the outage lasts)."""
    return req is not None and req.adapter is not None and req.adapter in ex.load_failures
