"""The scheduler's policy: plain Python over plain data, no gRPC, no tensors.

The service layer drives it with four calls per executor: `schedule(ex)` builds the next step plan,
`on_step_done(ex, plan, samples)` applies the sampled tokens, `on_load_done` reports an adapter
load, `on_executor_lost` hands a dead executor's work back to the queues. Requests enter with
`submit` and leave with `cancel` or by finishing. `start_load` and `wake` are the only ways out.
"""

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loraplex.errors import LoraplexError, Unavailable
from scheduler.block_manager import BlockManager
from scheduler.detokenizer import Finish
from scheduler.fairness import FairnessWeights, TenantQueues
from scheduler.request import ErrorEvent, FinishEvent, Request, Status
from scheduler.slots import Slot, SlotState, SlotTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int = 64  # running sequences per executor
    max_batched_tokens: int = 2048  # tokens per step per executor (long prompts are chunked)
    load_tokens_per_mib: float = 64.0  # token-equivalents a tenant pays per MiB of adapter it loads
    max_load_attempts: int = 2  # a failing adapter load is tried this often, then its requests fail


@dataclass(eq=False)
class Sequence:
    """A request's current run on one executor (a preempted request gets a new one)."""

    seq_id: int
    request: Request
    slot: Slot | None
    token_ids: list[int]  # every token the executor knows for it
    num_computed: int = 0  # tokens whose KV the executor has computed
    is_sent: bool = False  # its NewSequence went out


@dataclass
class ExecutorState:
    """What the scheduler knows of one executor: the single source of truth for placement."""

    address: str
    blocks: BlockManager
    slots: SlotTable
    max_rank: int
    running: dict[int, Sequence] = field(default_factory=dict)  # seq_id -> seq, admission order
    pending_frees: list[int] = field(default_factory=list)
    is_up: bool = True
    num_steps: int = 0
    num_loads: int = 0
    num_hits: int = 0


@dataclass
class StepPlan:
    freed: list[int]
    new: list[Sequence]
    rows: list[tuple[Sequence, int, list[int]]]  # (seq, num_tokens, new block ids), sorted by slot

    def __bool__(self) -> bool:
        return bool(self.rows)


@dataclass(frozen=True)
class Sample:
    seq_id: int
    token_id: int
    logprob: float


class Scheduler:
    def __init__(self, executors: Iterable[ExecutorState], weights: FairnessWeights, limits: Limits,
                 start_load: Callable[[ExecutorState, Slot], None], wake: Callable[[], None]):
        self.executors = list(executors)
        self.limits = limits
        self.queues: TenantQueues[Request] = TenantQueues(weights)
        self._start_load = start_load
        self._wake = wake
        self._seq_ids = itertools.count(1)
        self._load_failures: dict[str, int] = {}

    # ---- requests in and out ----------------------------------------------------------------
    def submit(self, req: Request) -> None:
        self.queues.push(req.tenant, req)
        self._ensure_loading(req)
        self._wake()

    def cancel(self, req: Request) -> None:
        """Forget a request whose client went away; frees whatever it held."""
        if req.status is Status.QUEUED:
            self.queues.remove(req.tenant, req)
        elif req.status is Status.RUNNING:
            ex, seq = self._find_running(req)
            self._release(ex, seq)
        req.status = Status.FINISHED
        self._wake()

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self, ex: ExecutorState) -> StepPlan:
        """Rows for the next step of `ex`: running sequences first, then admissions in fair order."""
        budget = self.limits.max_batched_tokens
        rows: list[tuple[Sequence, int, list[int]]] = []
        for seq in list(ex.running.values()):
            if budget == 0:
                break
            if seq.seq_id not in ex.running:  # preempted to make room for an earlier one
                continue
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if not self._make_room(ex, seq, seq.num_computed + n):
                continue
            rows.append((seq, n, ex.blocks.grow(seq.seq_id, seq.num_computed + n)))
            budget -= n
        if ex.is_up:
            rows += self._admit(ex, budget)
        rows.sort(key=lambda row: row[0].slot.index if row[0].slot else -1)
        new = [seq for seq, _, _ in rows if not seq.is_sent]
        freed, ex.pending_frees = ex.pending_frees, []
        return StepPlan(freed, new, rows)

    def on_step_done(self, ex: ExecutorState, plan: StepPlan, samples: Iterable[Sample]) -> None:
        ex.num_steps += 1
        for seq in plan.new:
            seq.is_sent = True
        for seq, n, _ in plan.rows:
            seq.num_computed += n
        for sample in samples:
            seq = ex.running.get(sample.seq_id)
            if seq is None:  # cancelled or preempted while the step ran
                continue
            seq.token_ids.append(sample.token_id)
            req = seq.request
            self.queues.charge_output(req.tenant)
            finish = req.on_sample(sample.token_id, sample.logprob)
            if finish is not None:
                self._finish(ex, seq, finish)

    def on_load_done(self, ex: ExecutorState, slot: Slot, adapter: str, error: LoraplexError | None) -> None:
        if slot.adapter != adapter or slot.state is not SlotState.LOADING:
            return  # the executor was lost meanwhile
        if error is None:
            ex.slots.mark_ready(slot)
            ex.num_loads += 1
            self._load_failures.pop(adapter, None)
        else:
            ex.slots.clear(slot)
            failures = self._load_failures.get(adapter, 0) + 1
            self._load_failures[adapter] = failures
            log.warning("loading %s on %s failed (%d): %s", adapter, ex.address, failures, error)
            if failures >= self.limits.max_load_attempts or not isinstance(error, Unavailable):
                self._load_failures.pop(adapter, None)
                self._fail_queued(adapter, error)
        self._wake()

    def on_executor_lost(self, ex: ExecutorState) -> None:
        """Requeue the work of an executor that went away; its slots and blocks are gone."""
        ex.is_up = False
        for seq in list(ex.running.values()):
            self._preempt(ex, seq)
        ex.pending_frees.clear()
        for slot in ex.slots.slots:
            slot.state, slot.adapter, slot.pins = SlotState.EMPTY, "", 0
        for req in [r for _, r in self.queues.in_fair_order()]:
            self._ensure_loading(req)
        self._wake()

    def has_work(self, ex: ExecutorState) -> bool:
        return bool(ex.running) or (ex.is_up and len(self.queues) > 0)

    # ---- admission --------------------------------------------------------------------------
    def _admit(self, ex: ExecutorState, budget: int) -> list[tuple[Sequence, int, list[int]]]:
        rows = []
        for tenant, req in self.queues.in_fair_order():
            if budget == 0 or len(ex.running) >= self.limits.max_num_seqs:
                break
            slot = ex.slots.find(req.adapter) if req.adapter else None
            if req.adapter and (slot is None or slot.state is not SlotState.READY):
                self._ensure_loading(req)
                continue  # waits for its adapter without holding anyone else back
            tokens = req.all_token_ids
            seq_id = next(self._seq_ids)
            if not ex.blocks.can_grow(seq_id, len(tokens) + 1):
                break  # the fairest request does not fit: admit nobody behind it
            self.queues.remove(tenant, req)
            blocks = ex.blocks.grow(seq_id, len(tokens))
            seq = Sequence(seq_id, req, slot, list(tokens))
            ex.running[seq_id] = seq
            if slot is not None:
                ex.slots.pin(slot)
                ex.num_hits += not req.caused_load
            if not req.is_charged:
                self.queues.charge_input(tenant, len(req.prompt_ids))
                req.is_charged = True
            req.status = Status.RUNNING
            req.admitted_at = req.admitted_at or time.monotonic()
            n = min(len(tokens), budget)
            rows.append((seq, n, blocks))
            budget -= n
        return rows

    def _ensure_loading(self, req: Request) -> None:
        """Prefetch: start loading the adapter of a queued request on the best executor for it."""
        if not req.adapter:
            return
        up = [ex for ex in self.executors if ex.is_up]
        if any(ex.slots.find(req.adapter) for ex in up):
            return
        candidates = [ex for ex in up if ex.slots.can_place()]
        if not candidates:
            return  # every slot is pinned: it waits, and is never failed for lack of a slot
        ex = min(candidates, key=lambda e: (not self._has_empty_slot(e), len(e.running)))
        slot = ex.slots.place(req.adapter, wanted={r.adapter for _, r in self.queues.in_fair_order()})
        req.caused_load = True
        self.queues.charge(req.tenant, self.limits.load_tokens_per_mib * req.adapter_bytes / 2**20)
        self._start_load(ex, slot)

    @staticmethod
    def _has_empty_slot(ex: ExecutorState) -> bool:
        return any(s.state is SlotState.EMPTY for s in ex.slots.slots)

    # ---- leaving the running set ------------------------------------------------------------
    def _make_room(self, ex: ExecutorState, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the latest admitted sequences until `seq` can hold `num_tokens`; False if `seq`
        itself had to go."""
        while not ex.blocks.can_grow(seq.seq_id, num_tokens):
            victim = next(reversed(ex.running.values()))
            self._preempt(ex, victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, ex: ExecutorState, seq: Sequence) -> None:
        """Give a running sequence's blocks back; its request recomputes later from all its tokens."""
        self._release(ex, seq)
        seq.request.status = Status.QUEUED
        self.queues.push(seq.request.tenant, seq.request, front=True)

    def _finish(self, ex: ExecutorState, seq: Sequence, reason: Finish) -> None:
        self._release(ex, seq)
        seq.request.status = Status.FINISHED
        seq.request.finish_reason = reason
        seq.request.emit(FinishEvent(reason))

    def _release(self, ex: ExecutorState, seq: Sequence) -> None:
        del ex.running[seq.seq_id]
        ex.blocks.free(seq.seq_id)
        if seq.slot is not None:
            ex.slots.unpin(seq.slot)
        if seq.is_sent:
            ex.pending_frees.append(seq.seq_id)

    def _fail_queued(self, adapter: str, error: LoraplexError) -> None:
        for tenant, req in list(self.queues.in_fair_order()):
            if req.adapter == adapter:
                self.queues.remove(tenant, req)
                req.status = Status.FINISHED
                req.emit(ErrorEvent(error))

    def _find_running(self, req: Request) -> tuple[ExecutorState, Sequence]:
        for ex in self.executors:
            for seq in ex.running.values():
                if seq.request is req:
                    return ex, seq
        raise RuntimeError(f"request {req.request_id} is RUNNING but on no executor")

    # ---- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests call it every step)."""
        for ex in self.executors:
            pins: dict[int, int] = {}
            for seq in ex.running.values():
                assert seq.request.status is Status.RUNNING, f"seq {seq.seq_id} runs a non-running request"
                if seq.slot is not None:
                    assert seq.slot.adapter == seq.request.adapter, f"seq {seq.seq_id} on a foreign slot"
                    pins[seq.slot.index] = pins.get(seq.slot.index, 0) + 1
            for slot in ex.slots.slots:
                assert slot.pins == pins.get(slot.index, 0), f"{ex.address} slot {slot.index} pins"
                assert slot.pins == 0 or slot.state is SlotState.READY, f"slot {slot.index} pinned unready"
            held = [a for a in (s.adapter for s in ex.slots.slots) if a]
            assert len(held) == len(set(held)), f"{ex.address}: an adapter in two slots"
            assert set(ex.blocks.tables) == set(ex.running), f"{ex.address}: blocks of unknown sequences"
            in_tables = sum(len(t) for t in ex.blocks.tables.values())
            assert in_tables == ex.blocks.num_allocated(), f"{ex.address}: blocks leaked"
