"""Placement: where each request waits. It holds, privately, the pool's executor list, the requests
that have nowhere to go (orphans), and per executor its queue (queues.py), the work ahead of it
and its adapters' popularity; it is the only writer of a request's executor.

A request is routed to the executor where it would start soonest (routing.py) and queued there;
its adapter is brought closer at once (residency). It moves when another executor would start
it sooner (an executor joined or admits again), when its own stops taking it (drained, lost,
dedicated to another adapter), and when it is preempted (back to the front of a queue). With no
executor admitting it waits as an orphan, within its deadlines.

What the others ask: `queue(ex)` (admission reads it), `wanted(ex)` and `popularity(ex, now)`
(residency evicts by them), `work_tokens(ex)` (operators' choices), `executors`, `orphans`,
`admitting()`, `expected_wait()`.
"""

import itertools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from common.adapter_ref import AdapterRef
from common.errors import FailedPrecondition
from scheduler.executor_state import ExecutorState
from scheduler.fairness import FairShare
from scheduler.grammar_prep import GrammarPrep
from scheduler.limits import Limits
from scheduler.queues import ExecutorQueue, QueueView, in_line
from scheduler.request import Request
from scheduler.residency.residency import Residency
from scheduler.routing import Popularity, home, score
from scheduler.steps.sequence import Sequence
from scheduler.steps.step_builder import StepBuilder

# A merged executor wins its adapter's requests unless its expected wait is this much longer
# than another's: it runs them without LoRA work, a gain not worth a long queue.
MERGED_BIAS_S = 0.1


@dataclass(eq=False)
class _Waiting:
    """What waits for one executor."""

    popularity: Popularity  # of the adapters routed to it
    queue: ExecutorQueue = field(default_factory=ExecutorQueue)
    work_tokens: float = 0.0  # tokens still to compute for its queued and running requests


class Placement:
    def __init__(self, limits: Limits, fair: FairShare, residency: Residency,
                 wake: Callable[[], None],
                 dedicated_to: Callable[[ExecutorState], AdapterRef | None],
                 grammars: GrammarPrep):
        """`dedicated_to(ex)`: the adapter ex is dedicated to (Merges), if any."""
        self.limits = limits
        self._executors: list[ExecutorState] = []
        self._orphans: list[Request] = []  # queued while no executor can take work
        self._at: dict[ExecutorState, _Waiting] = {}
        self._fair, self._residency, self._wake = fair, residency, wake
        self._dedicated_to = dedicated_to
        self._grammars = grammars

    # ---- what the others ask ----------------------------------------------------------------
    @property
    def executors(self) -> list[ExecutorState]:
        return self._executors

    @property
    def orphans(self) -> list[Request]:
        """Requests queued while no executor can take them."""
        return self._orphans

    def admitting(self) -> list[ExecutorState]:
        return [ex for ex in self._executors if ex.is_admitting]

    def queue(self, ex: ExecutorState) -> QueueView:
        return self._at[ex].queue

    def num_queued(self, ex: ExecutorState) -> int:
        return len(self._at[ex].queue)

    def queued(self) -> Iterator[Request]:
        """Every request queued on an executor (not the orphans)."""
        for ex in self._executors:
            yield from self._at[ex].queue

    def wanted(self, ex: ExecutorState) -> Collection[AdapterRef | None]:
        """The adapters queued requests want on ex."""
        return self._at[ex].queue.demand

    def popularity(self, ex: ExecutorState, now: float) -> Callable[[AdapterRef], float]:
        """Each adapter's popularity on ex at `now` (routing.Popularity)."""
        popularity = self._at[ex].popularity
        return lambda adapter: popularity.value(adapter, now)

    def work_tokens(self, ex: ExecutorState) -> float:
        return self._at[ex].work_tokens

    def kv_ahead(self, ex: ExecutorState, adapter: AdapterRef | None, steps: StepBuilder) -> int:
        """KV blocks the work ahead of a load of `adapter` on ex will take: the running
        sequences (`steps`, ex's step builder) as they grow, and whole, the requests queued
        ahead of `adapter`'s oldest (all of them, when none waits for it) whose adapter may
        start here now or once loaded (the base model's too), as many as max_num_seqs leaves
        seats for. The load leaves them these blocks (residency/adapter_memory.py): taken from
        them, they would take the pages of adapters that are waited for, loaded again later
        (churn). (They all start in time: they can; the oldest's own are not counted, for what
        it waits for might be pages of adapters that only it could make leave.) A request whose
        run would need pages that its KV cannot take (its own adapter's, a slot's reserved for a
        load, `adapter`'s maybe, or pinned by an operator) is not counted: held back for it, the
        load could wait for good. Counted up to the free blocks only: beyond them a load is left
        none either way (adapter_memory.free_for_pages), and the queue need not be walked."""
        blocks, free = steps.blocks_to_grow(ex.blocks), ex.blocks.num_free
        seats = self.limits.max_num_seqs - len(steps)
        if blocks >= free or seats <= 0:
            return blocks
        queue, part = self._at[ex].queue, self._residency.of(ex)
        heads = [queue.head(t, adapter) for t in queue.tenants()] if adapter else []
        first = min(filter(None, heads), key=in_line, default=None)
        room = ex.blocks.num_blocks - part.pages_kv_cannot_take()
        ahead = queue.ahead(lambda a: a != adapter and part.serves(a), first)
        for req in itertools.islice(ahead, seats):
            most = ex.blocks.most_blocks(req.max_tokens)
            own = part.pages_of(req) if req.ask.adapter else 0
            blocks += most if most + own <= room else 0
            if blocks >= free:
                break
        return blocks

    # ---- executors joining and leaving ------------------------------------------------------
    def add(self, ex: ExecutorState) -> list[ExecutorState]:
        """A view of an executor that (re)connected; the views it replaces (by address), which
        hold nothing queued any more."""
        replaced = [e for e in self._executors if e.address == ex.address]
        for old in replaced:
            self.remove(old)
        self._at[ex] = _Waiting(Popularity(half_life_s=self.limits.popularity_half_life_s))
        self._executors = self._executors + [ex]
        return replaced

    def remove(self, ex: ExecutorState) -> None:
        self._executors = [e for e in self._executors if e is not ex]
        self._at.pop(ex, None)

    def place_work(self) -> None:
        """Route the requests that had nowhere to go, and move queued ones to where they would
        start sooner now (an executor joined or admits again)."""
        orphans, self._orphans = self._orphans, []
        for req in orphans:
            self._fair.on_dequeue(req.ask.tenant)
            self.route(req)
        self._rebalance()
        self._wake()

    def evacuate(self, ex: ExecutorState) -> None:
        """Route ex's queued requests elsewhere (it admits no more)."""
        for req in list(self._at[ex].queue):
            self.move(req)

    # ---- routing ----------------------------------------------------------------------------
    def route(self, req: Request, front: bool = False) -> None:
        """Queue req where it would start soonest (`front`: ahead of its tenant's others, as a
        preempted request is)."""
        ex = self._best_executor(req)
        self._fair.on_enqueue(req.ask.tenant)
        if ex is None:
            req.executor = None
            self._orphans.append(req)
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
        adapter, dedicated_to = req.ask.adapter, self._dedicated_to
        candidates = [ex for ex in self._executors if ex.is_admitting
                      and dedicated_to(ex) in (None, adapter)
                      and ex.can_hold(req.max_tokens, self._residency.of(ex).pages_of(req),
                                      self.limits.max_batched_tokens)]
        if not candidates:
            return None
        if any(dedicated_to(ex) is not None for ex in candidates):
            return min(candidates, key=lambda e: self._score(e, req, False) + MERGED_BIAS_S * (
                dedicated_to(e) is None))
        addresses = [e.address for e in candidates]
        home_address = home(adapter, addresses) if adapter else ""
        return min(candidates, key=lambda e: self._score(e, req, e.address != home_address))

    def _score(self, ex: ExecutorState, req: Request, is_away: bool) -> float:
        part, adapter = self._residency.of(ex), req.ask.adapter
        resident = not adapter or part.holds(adapter)
        can_place = resident or part.can_place(adapter, part.pages_of(req))
        return score(self._at[ex].work_tokens, ex.rates, resident, can_place,
                     req.ask.adapter_bytes, self.limits.slot_wait_s,
                     self.limits.home_bias_s if is_away else 0.0)

    def _enqueue(self, ex: ExecutorState, req: Request, front: bool = False) -> None:
        req.executor = ex
        waiting, adapter = self._at[ex], req.ask.adapter
        if adapter and not front:
            waiting.popularity.hit(adapter, req.arrival)
        waiting.queue.push(req, front)
        waiting.work_tokens += req.max_tokens
        self._residency.of(ex).bring_closer(req)
        self._grammars.bring_closer(ex, req)

    def _rebalance(self) -> None:
        """Move queued requests to where they would start sooner now."""
        for req in sorted(self.queued(), key=lambda r: r.arrival):
            best = self._best_executor(req)
            if best is not None and best is not req.executor:
                waiting = self._at[req.executor]
                waiting.queue.remove(req)
                waiting.work_tokens -= req.max_tokens
                self._enqueue(best, req)

    # ---- leaving a queue, running -----------------------------------------------------------
    def dequeue(self, req: Request) -> None:
        if req.executor is None:
            self._orphans.remove(req)
        else:
            waiting = self._at[req.executor]
            waiting.queue.remove(req)
            waiting.work_tokens -= req.max_tokens
        self._fair.on_dequeue(req.ask.tenant)

    def start(self, ex: ExecutorState, req: Request, num_cached: int) -> None:
        """req leaves its queue to run on ex, `num_cached` of its tokens found in the prefix
        cache: the rest is ex's running work."""
        self.dequeue(req)
        self._at[ex].work_tokens += req.max_tokens - num_cached
        req.executor = ex

    def computed(self, ex: ExecutorState, num_tokens: int) -> None:
        """A step sent to ex computes `num_tokens` of its running work."""
        self._at[ex].work_tokens -= num_tokens

    def released(self, ex: ExecutorState, seq: Sequence) -> None:
        """seq runs on ex no more: the work it had left goes (its counters current)."""
        self._at[ex].work_tokens -= seq.request.max_tokens - seq.num_computed  # (start's)

    # ---- whether a request can wait ---------------------------------------------------------
    def check_placeable(self, adapter: AdapterRef) -> None:
        """FAILED_PRECONDITION when every slot of every admitting executor is pinned by an
        operator, so `adapter` could never load."""
        admitting = self.admitting()
        if admitting and all(self._residency.of(ex).could_never_load(adapter)
                             for ex in admitting):
            raise FailedPrecondition(
                f"every adapter slot of every executor is pinned by an operator, so {adapter} "
                "could never be loaded: evict a pinned adapter (Evict) or pre-warm this one")

    def expected_wait(self) -> float:
        """Seconds the queued work takes the pool at its measured rate: a retry-after hint."""
        up = self.admitting()
        rate = sum(ex.rates.tokens_per_second for ex in up)
        seconds = sum(self._at[ex].work_tokens for ex in up) / rate if rate else 60.0
        return min(60.0, max(1.0, seconds))

