"""Admission: which queued requests start on an executor in a step, and what each tenant is
charged. The only writer of the tenants' virtual counters (fairness.py: FairShare, whose backlog
counts Placement keeps by telling it of queue entries and exits).

A step admits in fair order: the backlogged tenant with the smallest counter first, its oldest
request that can start here now (its adapter READY here and within max_adapters_per_batch,
preferring adapters already running for up to affinity_max_wait_s), while the step's budget and
max_num_seqs last. A request starts only when its KV blocks fit (after the prefix cache's hits);
the fairest one that does not fit stops admission (nobody overtakes it). Under adapter
pressure (adapters that queued requests want sit idle in pages, which KV would take back:
ExecutorResidency.keeps_wanted_idle), while sequences run, a request starts only when its whole
run fits beside the blocks the running sequences will still grow into, and takes no pages of
wanted adapters: the resident adapters' requests are served before their adapters are evicted,
and nobody's growth evicts them (they would load twice in a wave). With nothing running, the
fairest request starts as soon as its prompt fits, taking wanted adapters' pages if it must
(else it could wait for good); and a pass that starts nobody on an executor that runs nothing
and brings nothing in leaves it stalled: its next load keeps no KV for the requests ahead.

A tenant whose oldest request cannot start has its adapter brought in (residency/), and so does
one whose oldest request has waited starvation_wait_s even while it has others that can start
(the anti-starvation rule: a slot drains for it when none is free). No tenant more than
fairness_window ahead of the least-served one is admitted, unless the executor would otherwise
sit idle with nothing on its way in.

Charges (VTC, fairness.py): a request's prompt tokens at its first admission (those the prefix
cache held are free), every sampled token, and the adapter load a request causes; each request's
record of them (request.py: Charges) is written here only.
"""

import collections
import heapq
import math
import operator
from collections.abc import Callable, Mapping

from common.adapter_ref import AdapterRef
from common.errors import ResourceExhausted, retry_after
from scheduler.executor_state import ExecutorState
from scheduler.fairness import FairShare
from scheduler.grammar_prep import GrammarPrep
from scheduler.limits import Limits
from scheduler.placement import Placement
from scheduler.queues import QueueView
from scheduler.request import Request
from scheduler.residency.executor_residency import ExecutorResidency
from scheduler.residency.residency import Residency
from scheduler.steps.longrope import enter_long, is_long
from scheduler.steps.prefix_cache import cached_prefix
from scheduler.steps.sequence import ScheduledRow, Sequence
from scheduler.steps.step_builder import blocks_to_grow

# The scheduler's side of an admission: start req on the executor with its tokens and prefix
# cache hits, within the budget left -> its first row.
Start = Callable[[Request, list[int], list[int], int], ScheduledRow]


class Admission:
    def __init__(self, limits: Limits, fair: FairShare, placement: Placement,
                 residency: Residency, clock: Callable[[], float], grammars: GrammarPrep):
        self.limits, self.fair, self.clock = limits, fair, clock
        self._placement, self._residency, self._grammars = placement, residency, grammars

    # ---- charges ----------------------------------------------------------------------------
    def charge_load(self, req: Request, ex: ExecutorState) -> None:
        """req caused its adapter's fetch onto ex: the tokens ex could make meanwhile (once per
        request, not per retry of a failed fetch)."""
        charges = req.charges
        if charges.caused_load:
            return
        charges.caused_load = True
        seconds = ex.rates.load_seconds(req.ask.adapter_bytes)
        self.fair.charge(req.ask.tenant, self.fair.weights.load_weight * seconds
                         * ex.rates.tokens_per_second)

    def charge_admitted(self, req: Request, num_cached: int) -> None:
        """req was admitted, `num_cached` of its tokens found in the prefix cache: its prompt
        tokens computed, at its first admission only."""
        charges = req.charges
        if not charges.is_input_charged:
            num_prompt = len(req.ask.prompt_ids)
            charges.cached_prompt_tokens = min(num_cached, num_prompt)
            self.fair.charge_input(req.ask.tenant, num_prompt - charges.cached_prompt_tokens)
            charges.is_input_charged = True

    def charge_samples(self, seqs: list[Sequence]) -> None:
        """A token was sampled for each of `seqs`."""
        for tenant, num_tokens in collections.Counter(map(_tenant_of, seqs)).items():
            self.fair.charge_output(tenant, num_tokens)

    # ---- who may wait, who goes ---------------------------------------------------------
    def check_backlog(self, tenant: str) -> None:
        """RESOURCE_EXHAUSTED (with retry-after) when `tenant` has max_queued_per_tenant
        requests waiting already."""
        cap, queued = self.limits.max_queued_per_tenant, self.fair.backlog.get(tenant, 0)
        if cap and queued >= cap:
            wait = self._placement.expected_wait()
            raise retry_after(ResourceExhausted(
                f"tenant {tenant!r} has {queued} requests waiting, the most this pool queues "
                f"for one tenant; retry in {wait:.0f}s"), wait)

    def victim(self, running: Mapping[int, Sequence]) -> Sequence:
        """The sequence to preempt when KV runs out: the most-served tenant's latest."""
        return max(running.values(),
                   key=lambda s: (self.fair.counter(s.request.ask.tenant), s.seq_id))

    # ---- admitting --------------------------------------------------------------------------
    def admit(self, ex: ExecutorState, running: Mapping[int, Sequence], budget: int,
              start: Start) -> list[ScheduledRow]:
        """Start requests queued on ex in fair order within `budget` tokens: their first rows.
        `running`: ex's running sequences (its step builder's; `start` adds to them)."""
        rows: list[ScheduledRow] = []
        part, q = self._residency.of(ex), self._placement.queue(ex)
        part.prepare_admission()
        heap = [(self.fair.counter(t), t) for t in q.tenants()]
        if not heap:
            part.admitted(False, False)
            return rows
        heapq.heapify(heap)
        active = {seq.request.ask.adapter for seq in running.values()
                  if seq.request.ask.adapter}
        is_fairest, room = True, _KvRoom(ex, part, running)
        # An executor that runs nothing and brings nothing in takes anyone: held idle for a
        # tenant whose adapter waits for slots that the queued requests of tenants ahead keep
        # wanted, it would wait for good (a load on its way keeps the window).
        is_stuck = not running and not part.is_bringing_in()
        ceiling = math.inf if is_stuck else self._ceiling()
        if self.limits.starvation_wait_s:
            self._feed_starving(q, part, ceiling)
        while heap and budget > 0 and len(running) < self.limits.max_num_seqs:
            counter, tenant = heapq.heappop(heap)
            if counter != self.fair.counter(tenant):  # charged since it was pushed
                heapq.heappush(heap, (self.fair.counter(tenant), tenant))
                continue
            if counter > ceiling:
                break  # everyone left is too far ahead of a tenant still waiting
            req = self._pick(ex, q, part, tenant, active, is_fairest)
            is_fairest = False
            if req is None:
                continue  # nothing of this tenant can start here yet
            tokens = req.all_token_ids
            if is_long(len(tokens), ex.rope_switch_len):
                enter_long(req)  # (its blocks named apart from short runs': longrope.py)
            hits = cached_prefix(ex.blocks, req, tokens)
            if not room.make(req, tokens, hits, budget):
                break  # the fairest request does not fit: admit nobody behind it
            row = start(req, tokens, hits, budget)
            room.started(row.seq)
            rows.append(row)
            budget -= row.num_tokens
            if req.ask.adapter:
                active.add(req.ask.adapter)
            if q.queued(tenant):
                heapq.heappush(heap, (self.fair.counter(tenant), tenant))
        part.admitted(bool(rows), is_stuck and not part.is_bringing_in())
        return rows

    def _pick(self, ex: ExecutorState, q: QueueView, part: ExecutorResidency, tenant: str,
              active: set[AdapterRef], is_fairest: bool) -> Request | None:
        """The tenant's oldest request that can start now (its adapter READY here, within the
        distinct-adapter limit, preferring running adapters for up to affinity_max_wait_s; its
        grammar, if any, compiled here: grammar_prep.py). When none can, bring in the adapter
        of its oldest request."""
        max_adapters = self.limits.max_adapters_per_batch
        heads = [q.head(tenant, None)]
        heads += [q.head(tenant, adapter) for adapter in part.admissible()]
        heads = [r for r in heads if r is not None and (
            not max_adapters or not r.ask.adapter or r.ask.adapter in active
            or len(active) < max_adapters) and self._grammars.is_ready(ex, r)]
        if heads:
            heads.sort(key=lambda r: r.arrival)
            wait = self.limits.affinity_max_wait_s
            if wait > 0 and self.clock() - heads[0].arrival < wait:
                heads.sort(key=lambda r: bool(r.ask.adapter) and r.ask.adapter not in active)
            return heads[0]
        oldest = q.oldest(tenant)
        if oldest is not None:
            part.bring_in_for_oldest(oldest, is_fairest)
        return None

    def _feed_starving(self, q: QueueView, part: ExecutorResidency, ceiling: float) -> None:
        """The anti-starvation rule: a tenant's oldest request here that has waited
        starvation_wait_s has its adapter brought in (a slot reserved to drain for it when none
        is free), even while its tenant has other requests that can start, the longest waiting
        first; not for a tenant the fairness window holds back."""
        since = self.clock() - self.limits.starvation_wait_s
        oldest = [q.oldest(t) for t in q.tenants() if self.fair.counter(t) <= ceiling]
        starving = [r for r in oldest if r is not None and r.queued_since <= since
                    and r.ask.adapter and not part.holds(r.ask.adapter)]
        for req in sorted(starving, key=_queued_since):
            part.bring_in_for_oldest(req, may_reserve=True)

    def _ceiling(self) -> float:
        """No tenant more than fairness_window ahead of the least-served backlogged tenant is
        admitted, except that a tenant whose oldest request waits for an adapter whose loads are
        failing (a store or S3 down: its loads back off) holds nobody back: it cannot be served
        whatever the others do, and the window would stall the pool for as long as the outage."""
        window = self.limits.fairness_window
        if not window:
            return math.inf
        executors, of = self._placement.executors, self._residency.of
        if not any(of(ex).has_failing_loads() for ex in executors):
            return self.fair.min_backlogged() + window
        servable = []
        for ex in executors:
            q, part = self._placement.queue(ex), of(ex)
            servable += [self.fair.counter(t) for t in q.tenants()
                         if not part.waits_on_a_failing_load(q.oldest(t))]
        servable += [self.fair.counter(r.ask.tenant) for r in self._placement.orphans]
        return min(servable) + window if servable else math.inf


class _KvRoom:
    """The KV blocks for the requests one admission pass starts on an executor (the module's
    doc: under adapter pressure, whole runs)."""

    def __init__(self, ex: ExecutorState, part: ExecutorResidency,
                 running: Mapping[int, Sequence]):
        self._blocks, self._part, self._running = ex.blocks, part, running
        self._is_pressed: bool | None = None  # (asked once a pass: admissions only pin)
        self._growth = 0  # blocks the running sequences will still grow into, once pressed

    def make(self, req: Request, tokens: list[int], hits: list[int], budget: int) -> bool:
        """Room for req to start with `tokens`, its first blocks `hits`, its first row within
        `budget` tokens: pages of adapters nobody runs go back to KV first (of adapters queued
        requests want too, unless pressed). Whether req can start."""
        blocks, keep = self._blocks, req.ask.adapter
        first_end = min(len(tokens), len(hits) * blocks.block_size + budget) + 1
        if self._running and self._pressed():
            whole = max(req.max_tokens, len(tokens) + 1)
            return self._part.make_kv_room(
                lambda: blocks.can_start(hits, len(tokens) + 1, first_end, whole, self._growth),
                keep=keep)
        return self._part.make_kv_room(
            lambda: blocks.can_start(hits, len(tokens) + 1, first_end),
            wanted_too=True, keep=keep)

    def started(self, seq: Sequence) -> None:
        if self._is_pressed:
            self._growth += blocks_to_grow((seq,), self._blocks)

    def _pressed(self) -> bool:
        if self._is_pressed is None:
            self._is_pressed = self._part.keeps_wanted_idle()
            if self._is_pressed:
                self._growth = blocks_to_grow(self._running.values(), self._blocks)
        return self._is_pressed


_tenant_of = operator.attrgetter("request.ask.tenant")
_queued_since = operator.attrgetter("queued_since")
