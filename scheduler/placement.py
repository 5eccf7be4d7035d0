"""Placement: where each request waits. The only writer of the pool's executor list, the requests
that have nowhere to go (orphans), each executor's queue (queues.py), its work ahead and its
adapters' popularity, and of a request's executor.

A request is routed to the executor where it would start soonest (routing.py) and queued there;
its adapter is brought closer at once (residency.py). It moves when another executor would start
it sooner (an executor joined or admits again), when its own stops taking it (drained, lost,
dedicated to another adapter), and when it is preempted (back to the front of a queue). With no
executor admitting it waits as an orphan, within its deadlines.
"""

from collections.abc import Callable

from common.adapter_ref import AdapterRef
from common.errors import FailedPrecondition
from scheduler.executor_state import ExecutorState
from scheduler.fairness import FairShare
from scheduler.limits import Limits
from scheduler.request import Request
from scheduler.residency.residency import Residency
from scheduler.routing import home, score
from scheduler.steps.sequence import Sequence

# A merged executor wins its adapter's requests unless its expected wait is this much longer
# than another's: it runs them without LoRA work, a gain not worth a long queue.
MERGED_BIAS_S = 0.1


class Placement:
    def __init__(self, limits: Limits, fair: FairShare, residency: Residency,
                 wake: Callable[[], None]):
        self.limits = limits
        self.executors: list[ExecutorState] = []
        self.orphans: list[Request] = []  # queued while no executor can take work
        self._fair, self._residency, self._wake = fair, residency, wake

    def admitting(self) -> list[ExecutorState]:
        return [ex for ex in self.executors if ex.is_admitting]

    # ---- executors joining and leaving ------------------------------------------------------
    def add(self, ex: ExecutorState) -> None:
        ex.popularity.half_life_s = self.limits.popularity_half_life_s
        self.executors = [e for e in self.executors if e.address != ex.address] + [ex]

    def remove(self, ex: ExecutorState) -> None:
        self.executors = [e for e in self.executors if e is not ex]

    def place_work(self) -> None:
        """Route the requests that had nowhere to go, and move queued ones to where they would
        start sooner now (an executor joined or admits again)."""
        orphans, self.orphans = self.orphans, []
        for req in orphans:
            self._fair.on_dequeue(req.tenant)
            self.route(req)
        self._rebalance()
        self._wake()

    def evacuate(self, ex: ExecutorState) -> None:
        """Route ex's queued requests elsewhere (it admits no more)."""
        for req in list(ex.queue):
            self.move(req)

    # ---- routing ----------------------------------------------------------------------------
    def route(self, req: Request, front: bool = False) -> None:
        """Queue req where it would start soonest (`front`: ahead of its tenant's others, as a
        preempted request is)."""
        ex = self._best_executor(req)
        self._fair.on_enqueue(req.tenant)
        if ex is None:
            req.executor = None
            self.orphans.append(req)
            return
        self._enqueue(ex, req, front)

    def move(self, req: Request) -> None:
        """Route a queued request again (its executor no longer takes it)."""
        self.dequeue(req)
        self.route(req)

    def _best_executor(self, req: Request) -> ExecutorState | None:
        """The executor where req would start soonest: its adapter's home (rendezvous hash) wins
        ties by home_bias_s, an executor it is merged into (merging.py) by MERGED_BIAS_S. Only
        executors whose KV can hold it whole (a pool's executors may differ)."""
        candidates = [ex for ex in self.executors if ex.is_admitting and ex.serves(req.adapter)
                      and ex.can_hold(req, self._residency.pages_of(ex, req))]
        if not candidates:
            return None
        if any(ex.dedicated_to is not None for ex in candidates):
            return min(candidates, key=lambda e: self._score(e, req, False) + MERGED_BIAS_S * (
                e.dedicated_to is None))
        addresses = [e.address for e in candidates]
        home_address = home(req.adapter, addresses) if req.adapter else ""
        return min(candidates, key=lambda e: self._score(e, req, e.address != home_address))

    def _score(self, ex: ExecutorState, req: Request, is_away: bool) -> float:
        resident = not req.adapter or ex.slots.find(req.adapter) is not None
        can_place = resident or self._residency.can_place(ex, req.adapter,
                                                           self._residency.pages_of(ex, req))
        return score(ex.work_tokens, ex.rates, resident, can_place, req.adapter_bytes,
                     self.limits.slot_wait_s, self.limits.home_bias_s if is_away else 0.0)

    def _enqueue(self, ex: ExecutorState, req: Request, front: bool = False) -> None:
        req.executor = ex
        if req.adapter and not front:
            ex.popularity.hit(req.adapter, req.arrival)
        ex.queue.push(req, front)
        ex.work_tokens += req.max_tokens
        self._residency.bring_closer(ex, req)

    def _rebalance(self) -> None:
        """Move queued requests to where they would start sooner now."""
        queued = (r for ex in self.executors for r in ex.queue)
        for req in sorted(queued, key=lambda r: r.arrival):
            best = self._best_executor(req)
            if best is not None and best is not req.executor:
                req.executor.queue.remove(req)
                req.executor.work_tokens -= req.max_tokens
                self._enqueue(best, req)

    # ---- leaving a queue, running -----------------------------------------------------------
    def dequeue(self, req: Request) -> None:
        if req.executor is None:
            self.orphans.remove(req)
        else:
            req.executor.queue.remove(req)
            req.executor.work_tokens -= req.max_tokens
        self._fair.on_dequeue(req.tenant)

    def start(self, ex: ExecutorState, req: Request, num_cached: int) -> None:
        """req leaves its queue to run on ex, `num_cached` of its tokens found in the prefix
        cache: the rest is ex's running work."""
        self.dequeue(req)
        ex.work_tokens += req.max_tokens - num_cached
        req.executor = ex

    @staticmethod
    def computed(ex: ExecutorState, num_tokens: int) -> None:
        """A step sent to ex computes `num_tokens` of its running work."""
        ex.work_tokens -= num_tokens

    @staticmethod
    def released(ex: ExecutorState, seq: Sequence) -> None:
        """seq runs on ex no more: the work it had left goes (its counters current)."""
        ex.work_tokens -= seq.request.max_tokens - seq.num_computed  # (what start counted)

    # ---- whether a request can wait ---------------------------------------------------------
    def check_placeable(self, adapter: AdapterRef) -> None:
        """FAILED_PRECONDITION when every slot of every admitting executor is pinned by an
        operator, so `adapter` could never load."""
        admitting = self.admitting()
        if admitting and all(ex.slots.find(adapter) is None and ex.slots.are_all_admin_pinned()
                             for ex in admitting):
            raise FailedPrecondition(
                f"every adapter slot of every executor is pinned by an operator, so {adapter} "
                "could never be loaded: evict a pinned adapter (Evict) or pre-warm this one")

    def expected_wait(self) -> float:
        """Seconds the queued work takes the pool at its measured rate: a retry-after hint."""
        up = self.admitting()
        rate = sum(ex.rates.tokens_per_second for ex in up)
        seconds = sum(ex.work_tokens for ex in up) / rate if rate else 60.0
        return min(60.0, max(1.0, seconds))
