"""The scheduler's policy: plain Python over plain data, no gRPC, no tensors.

The service (engine.py) and the simulator (sim/simulator.py) drive the very same object:
`submit`/`cancel` requests; per executor `schedule(ex)` -> StepPlan, then `on_step_done` with the
sampled tokens; `on_load_done` when an adapter load ends; an executor's life through
`add_executor`, `on_executor_lost`, `drain`/`resume`, `leave`, `stop` and `remove_executor`; the
admin actions in admin.py; `stats()` for the Stats RPC. `start_load`, `start_unload`, `warm_host`
and `wake` are its only ways out.

A request is routed to one executor when it arrives (routing.py) and waits in that executor's
queue (queues.py) until admission finds, in fair order (fairness.py), that its KV blocks fit and
its adapter is READY there (slots.py); its adapter then stays pinned until it finishes. Where
requests wait and how they move between executors is placement.py; what an executor's loads and
life do to them is executor_events.py; Scheduler builds on both.
"""

import collections
import heapq
import itertools
import logging
import math
import operator

from common.adapter_ref import AdapterRef
from common.detokenizer import Finish
from common.errors import (
    DeadlineExceeded,
    LoraplexError,
    ResourceExhausted,
    Unavailable,
    retry_after,
)
from scheduler import merging
from scheduler.deadlines import Due
from scheduler.executor_events import ExecutorEvents
from scheduler.executor_state import (
    ExecutorState,
    Limits,
    Sample,
    Samples,
    ScheduledRow,
    Sequence,
    StepPlan,
    row_slot,
)
from scheduler.prefix_cache import cache_key, cached_prefix, publish
from scheduler.quiet_samples import quiet_samples, take_quiet
from scheduler.request import FinishEvent, Request, Status
from scheduler.slots import SlotState
from scheduler.stats import PoolStats, snapshot

log = logging.getLogger(__name__)
# An adapter staged on an executor and not taken into a slot within this long is staged again
# when wanted (executors drop staged bytes after EXECUTOR_STAGED_TTL_S, which is longer).
STAGED_TTL_S = 60.0
__all__ = ["ExecutorState", "Limits", "Sample", "Samples", "ScheduledRow", "Scheduler",
           "Sequence", "StepPlan"]


class Scheduler(ExecutorEvents):
    # ---- requests in and out ----------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request, or refuse it now: its tenant has max_queued_per_tenant waiting
        (RESOURCE_EXHAUSTED), or every slot of every executor is pinned by an operator
        (FAILED_PRECONDITION: its adapter could never load)."""
        req.arrival = req.queued_since = self.clock()
        self._check_tenant_backlog(req.tenant)
        if req.adapter:
            self._check_placeable(req.adapter)
        req.work_left = len(req.prompt_ids) + req.output.max_new_tokens
        if self.limits.prefix_cache != "off":
            req.cache_key = cache_key(self.limits.prefix_cache, req.tenant, req.adapter,
                                      req.cache_salt)
        self.deadlines.add(req)
        self._route(req)
        self._wake()

    def expire(self) -> None:
        """Drop the waiting requests whose time is up (see deadlines.py); wake the executors
        when an adapter's load may be tried again. The engine calls this on a clock tick."""
        now = self.clock()
        self.merges.tick(self, now)
        for req, due in self.deadlines.due(now):
            self._fail(req, self._expiry_error(req, due, now))
        for ex in self.executors:
            ex.slots.drop_staged_before(now - STAGED_TTL_S)  # executors keep them a while only
            for adapter, failure in list(ex.load_failures.items()):
                if adapter not in ex.queue.demand:
                    del ex.load_failures[adapter]  # nobody waits for it here any more
                elif failure.retry_at <= now and not failure.is_due:
                    failure.is_due = True  # its backoff just passed: try again
                    self._wake()

    def _expiry_error(self, req: Request, due: Due, now: float) -> LoraplexError:
        waited = now - req.arrival
        if due is Due.DEADLINE:
            return DeadlineExceeded(f"the request's deadline passed after {waited:.1f}s "
                                    "waiting for an executor")
        if req.admitted_at is not None:
            return Unavailable(f"waited {now - req.queued_since:.0f}s to be resumed after its "
                               "executor was lost or its KV preempted, past the pool's "
                               "max_queue_s; retry")
        failure = req.executor.load_failures.get(req.adapter) if req.executor else None
        if failure is not None:
            return retry_after(Unavailable(
                f"adapter {req.adapter} could not be loaded within {waited:.0f}s "
                f"(last error: {failure.error}); retry later"), self.limits.max_load_backoff_s)
        wait = self._expected_wait()
        return retry_after(ResourceExhausted(
            f"not admitted within {waited:.0f}s (the pool's max_queue_s): the pool is "
            f"overloaded or has no executor up; retry in {wait:.0f}s"), wait)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self, ex: ExecutorState) -> StepPlan:
        """Rows for the next step of `ex`: its cohort's decode rows, its other running sequences,
        then admissions in fair order. (Runs for every step: its loops stay plain.)"""
        running, blocks, cohort = ex.running, ex.blocks, ex.cohort
        bs = blocks.block_size
        step = cohort.steps + 1
        ex.unjoin(cohort.due(step))
        budget = self.limits.max_batched_tokens - len(cohort)  # (never below 0: cohort.py)
        decode: list[Sequence] = []  # rows of one known token, in its blocks, that samples
        rows: list[ScheduledRow] = []  # the others
        preempted = False
        for _, seq in sorted(ex.loose.items()):  # (in admission order: the older first)
            if budget == 0:
                break
            if preempted and seq.seq_id not in running:  # preempted to make room for another
                continue
            known = seq.own_known  # what the executor will have
            n = known - seq.own_computed
            if n == 1 and known < seq.decode_below:
                decode.append(seq)
                budget -= 1
                continue
            if known >= seq.max_tokens and known > len(seq.token_ids):
                continue  # its last token is on its way: nothing more to compute
            if n <= 0:
                continue
            if n > budget:
                n = budget
            end = seq.own_computed + n
            if end <= seq.capacity:
                new_blocks = ()
            else:
                new_blocks = blocks.try_grow(seq.seq_id, end)
                if new_blocks is None:
                    num_running = len(running)
                    is_room = self._make_room(ex, seq, end)
                    preempted = preempted or len(running) != num_running
                    if not is_room:
                        continue
                    new_blocks = blocks.grow(seq.seq_id, end)
                seq.hold(len(blocks.tables[seq.seq_id]) * bs)
            rows.append(ScheduledRow(seq, n, new_blocks, end == known))
            budget -= n
        if preempted:  # drop the rows of sequences preempted after their row was made
            rows = [row for row in rows if row.seq.seq_id in running]
            decode = [seq for seq in decode if seq.seq_id in running]
            budget = (self.limits.max_batched_tokens - len(cohort) - len(decode)  # (theirs
                      - sum(row.num_tokens for row in rows))  # back, a preempted member's too)
        if ex.is_admitting:
            admitted = self._admit(ex, budget)
            new = [row.seq for row in admitted]
            for seq in new:  # sent now: one cancelled while this step runs must be freed after it
                seq.is_sent = True
            rows += admitted
        else:
            new = []
        # Counted as computed once sent: the next plan may follow at once. The members move with
        # the cohort's step count.
        cohort.steps = step
        num_tokens = num_samples = len(decode) + len(cohort)
        member_rows = cohort.rows()
        for seq in decode:
            computed = seq.own_computed = seq.own_known
            seq.own_known = computed + 1
            seq.own_last_step = step
            if computed >= seq.publish_at:  # (publish's cheap half)
                publish(blocks, seq)
            if cohort.join(seq):
                del ex.loose[seq.seq_id]
        for row in rows:
            seq, n = row.seq, row.num_tokens
            computed = seq.own_computed = seq.own_computed + n
            seq.own_known += row.samples
            num_samples += row.samples
            seq.own_last_step = step
            num_tokens += n
            if computed >= seq.publish_at:
                publish(blocks, seq)
        ex.work_tokens -= num_tokens
        rows += member_rows
        rows += map(_decode_row, decode)
        rows.sort(key=row_slot)
        freed, ex.pending_frees = ex.pending_frees, []
        unmerge = merging.unmerge_now(ex)
        return StepPlan(step, freed, new, rows, num_tokens, num_samples,
                        merging.merge_now(self, ex), unmerge)

    def on_step_done(self, ex: ExecutorState, plan: StepPlan, samples: Samples,
                     step_seconds: float = 0.0) -> None:
        """The answer to `plan`, the oldest step in flight on `ex`: its sampled tokens."""
        ex.num_steps += bool(plan.rows)  # (a step that only frees sequences computes nothing)
        ex.rates.observe_step(plan.num_tokens, step_seconds)
        ex.steps_answered = max(ex.steps_answered, plan.step)
        merging.on_step_done(ex, plan)
        for seq in [s for s in ex.unpin_later if not ex.is_in_flight(s)]:
            ex.unpin_later.remove(seq)  # (the step loop plans next: a freed slot is seen then)
            ex.slots.unpin(seq.slot)
        now = self.clock()
        self.merges.observe(plan, now)
        seqs = list(map(ex.running.get, samples.seq_ids))
        token_ids, logprobs = list(samples.token_ids), samples.logprobs  # (read more than once)
        if None in seqs:  # cancelled, preempted or finished while the step ran
            kept = list(map(operator.is_not, seqs, itertools.repeat(None)))
            seqs = list(itertools.compress(seqs, kept))
            token_ids = list(itertools.compress(token_ids, kept))
            logprobs = list(itertools.compress(logprobs, kept))
        for tenant, num_tokens in collections.Counter(map(_tenant_of, seqs)).items():
            self.fair.charge_output(tenant, num_tokens)
        quiet = quiet_samples(seqs, token_ids, ex.stop_ids)  # (taken as columns)
        if all(quiet):
            return take_quiet(seqs, token_ids, logprobs)
        if any(quiet):
            take_quiet(list(itertools.compress(seqs, quiet)),
                       list(itertools.compress(token_ids, quiet)),
                       list(itertools.compress(logprobs, quiet)))
        for i in itertools.compress(range(len(quiet)), map(operator.not_, quiet)):
            self._take_sample(ex, seqs[i], token_ids[i], logprobs[i], now)

    def _take_sample(self, ex: ExecutorState, seq: Sequence, token_id: int, logprob: float,
                     now: float) -> None:
        """A sample the long way: it may publish blocks, be the first token, end the request."""
        tokens = seq.token_ids
        tokens.append(token_id)
        if len(tokens) >= seq.publish_at:  # (publish's cheap half)
            publish(ex.blocks, seq)
        finish = seq.request.on_sample(token_id, logprob, now)
        if finish is not None:
            self._finish(ex, seq, finish)
        else:
            seq.requiet()

    # ---- admission --------------------------------------------------------------------------
    def _admit(self, ex: ExecutorState, budget: int) -> list[ScheduledRow]:
        rows = []
        ex.slots.drop_reservations(ex.queue.demand)
        self._load_into_drained(ex)
        heap = [(self.fair.counter(t), t) for t in ex.queue.tenants()]
        if not heap:
            return rows
        heapq.heapify(heap)
        active = {seq.request.adapter for seq in ex.running.values() if seq.request.adapter}
        is_fairest = True
        # An executor that runs nothing and brings nothing in takes anyone: held idle for a
        # tenant whose adapter waits for slots that the queued requests of tenants ahead keep
        # wanted, it would wait for good (a load on its way keeps the window).
        is_stuck = not ex.running and not ex.slots.is_bringing_in()
        ceiling = math.inf if is_stuck else self._fairness_ceiling()
        while heap and budget > 0 and len(ex.running) < self.limits.max_num_seqs:
            counter, tenant = heapq.heappop(heap)
            if counter != self.fair.counter(tenant):  # charged since it was pushed
                heapq.heappush(heap, (self.fair.counter(tenant), tenant))
                continue
            if counter > ceiling:
                break  # everyone left is too far ahead of a tenant still waiting
            req = self._pick(ex, tenant, active, is_fairest)
            is_fairest = False
            if req is None:
                continue  # nothing of this tenant can start here yet
            tokens = req.all_token_ids
            hits = cached_prefix(ex.blocks, req, tokens)
            if not ex.blocks.can_start(hits, len(tokens) + 1):
                break  # the fairest request does not fit: admit nobody behind it
            seq_id = next(self._seq_ids)
            table = ex.blocks.start(seq_id, hits, len(tokens))
            seq = self._start(ex, req, seq_id, tokens, len(hits))
            seq.hold(len(table) * ex.blocks.block_size)
            n = min(len(tokens) - seq.num_cached, budget)
            rows.append(ScheduledRow(seq, n, table, samples=seq.num_cached + n == len(tokens)))
            budget -= n
            if req.adapter:
                active.add(req.adapter)
            if ex.queue.queued(tenant):
                heapq.heappush(heap, (self.fair.counter(tenant), tenant))
        return rows

    def _load_into_drained(self, ex: ExecutorState) -> None:
        """A slot reserved for a staged adapter, once drained, takes it at once: its requests
        may no longer be any tenant's oldest (those could be for the drained slot's adapter,
        which a reserved slot admits no more), and nothing else would start the load."""
        for slot in ex.slots.slots:
            adapter = slot.reserved_for
            if adapter is None or slot.pins or slot.state is not SlotState.READY:
                continue
            staged = ex.slots.staged(adapter)
            if staged is not None and staged.staged_at is not None:
                self.start_load_on(ex, adapter, staged.num_bytes)

    def _pick(self, ex: ExecutorState, tenant: str, active: set[AdapterRef],
              is_fairest: bool) -> Request | None:
        """The tenant's oldest request that can start on ex now (its adapter READY here, within
        the distinct-adapter limit, preferring running adapters for up to affinity_max_wait_s).
        When none can, bring in the adapter of its oldest request: load it if a slot is free, or,
        for the fairest tenant, reserve a slot to drain for it."""
        q, max_adapters = ex.queue, self.limits.max_adapters_per_batch
        heads = [q.head(tenant, None)]
        heads += [q.head(tenant, s.adapter) for s in ex.slots.admissible()]
        heads = [r for r in heads if r is not None and (
            not max_adapters or not r.adapter or r.adapter in active or len(active) < max_adapters)]
        if heads:
            heads.sort(key=lambda r: r.arrival)
            wait = self.limits.affinity_max_wait_s
            if wait > 0 and self.clock() - heads[0].arrival < wait:
                heads.sort(key=lambda r: bool(r.adapter) and r.adapter not in active)
            return heads[0]
        oldest = q.oldest(tenant)
        if oldest is not None and oldest.adapter and ex.slots.find(oldest.adapter) is None:
            staged = ex.slots.staged(oldest.adapter)
            is_staged = staged is not None and staged.staged_at is not None
            if not self._place(ex, oldest) and is_staged and is_fairest and \
                    ex.slots.num_reserved() < self.limits.max_reserved_slots:
                ex.slots.reserve(oldest.adapter)  # its bytes are here: drain a slot for it
        return None

    def _start(self, ex: ExecutorState, req: Request, seq_id: int, tokens: list[int],
               num_hits: int) -> Sequence:
        """Run req on ex as seq_id, its first `num_hits` blocks found in the prefix cache."""
        self._dequeue(req)
        slot = ex.slots.find(req.adapter) if req.adapter else None
        cached = num_hits * ex.blocks.block_size
        seq = Sequence(seq_id, req, slot, list(tokens), own_computed=cached, num_cached=cached,
                       num_published=num_hits)
        ex.start(seq)
        req.work_left -= cached
        ex.work_tokens += req.work_left
        req.executor = ex
        if slot is not None:
            ex.slots.pin(slot)
            ex.num_hits += not req.caused_load
        if not req.is_charged:  # the prompt tokens it computes (fairness.py)
            req.cached_prompt_tokens = min(cached, len(req.prompt_ids))
            self.fair.charge_input(req.tenant, len(req.prompt_ids) - req.cached_prompt_tokens)
            req.is_charged = True
        req.status = Status.RUNNING
        req.admitted_at = req.admitted_at or self.clock()
        return seq

    # ---- leaving the running set ------------------------------------------------------------
    def _make_room(self, ex: ExecutorState, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the most-served tenants' latest sequences until `seq` can hold `num_tokens`;
        False if `seq` itself had to go."""
        while not ex.blocks.can_grow(seq.seq_id, num_tokens):
            victim = max(ex.running.values(),
                         key=lambda s: (self.fair.counter(s.request.tenant), s.seq_id))
            self._preempt(ex, victim)
            if victim is seq:
                return False
        return True

    def _finish(self, ex: ExecutorState, seq: Sequence, reason: Finish) -> None:
        self._release(ex, seq)
        seq.request.finish_reason = reason
        self._end(seq.request)
        seq.request.emit(FinishEvent(reason))

    def has_work(self, ex: ExecutorState) -> bool:
        return bool(ex.running) or (ex.is_admitting and len(ex.queue) > 0)

    def stats(self) -> PoolStats:
        return snapshot(self.executors, self.fair, self.totals)


_decode_row = operator.attrgetter("decode_row")
_tenant_of = operator.attrgetter("tenant")
