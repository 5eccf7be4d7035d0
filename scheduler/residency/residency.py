"""Residency: which adapter sits in which slot of each executor, how adapters get there, and who
pins them. The only writer of each executor's slot table (slots.py), load failures, deferred
unpins and residency counters.

An adapter is brought closer as soon as a request for it is queued (prefetch): into an empty
slot at once; into another adapter's slot only once its bytes are staged on the executor's host
(stage before evict, slots.py), else the store is asked to warm it into its RAM tier. The tenant
whose request first causes a fetch pays for it (`charge_load`, fairness.py). A fetch that fails
retryably (a store or S3 down or frozen) backs off, doubling from load_backoff_s to
max_load_backoff_s; any other failure is returned to the scheduler, which fails the requests
waiting for that adapter. A running sequence pins its adapter's slot until no step in flight
has a row of it.
"""

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from common.adapter_ref import AdapterRef
from common.errors import Aborted, FailedPrecondition, LoraplexError, Unavailable
from scheduler.executor_state import ExecutorState
from scheduler.limits import Limits
from scheduler.request import Request
from scheduler.residency.adapter_memory import AdapterMemory
from scheduler.residency.slots import Slot, SlotState
from scheduler.routing import score
from scheduler.steps.sequence import Sequence

log = logging.getLogger(__name__)
# An adapter staged on an executor and not taken into a slot within this long is staged again
# when wanted (executors drop staged bytes after EXECUTOR_STAGED_TTL_S, which is longer).
STAGED_TTL_S = 60.0


@dataclass
class LoadFailure:
    """An adapter whose loads keep failing on an executor, retryably: when to try again."""

    count: int
    retry_at: float  # scheduler clock
    error: LoraplexError
    is_due: bool = False  # the executors were woken once its backoff passed


class Residency:
    def __init__(self, limits: Limits, clock: Callable[[], float],
                 start_load: Callable[[ExecutorState, Slot], None],
                 start_unload: Callable[..., None],
                 start_stage: Callable[[ExecutorState, AdapterRef, int], None],
                 warm_host: Callable[[AdapterRef], None],
                 charge_load: Callable[[Request, ExecutorState], None]):
        self.limits, self.clock = limits, clock
        self._start_load, self._start_unload = start_load, start_unload
        self._start_stage, self._warm_host = start_stage, warm_host
        self._charge_load = charge_load
        self.memory = AdapterMemory(limits)

    # ---- what routing and admission ask ----------------------------------------------------
    def can_place(self, ex: ExecutorState, adapter: AdapterRef, num_pages: int = 0) -> bool:
        """A slot of ex could take `adapter` now (an empty one, or one nobody pins or wants),
        and its `num_pages` pages could be found (adapter_memory.py)."""
        popularity = self._popularity(ex)
        victim = ex.slots.victim(adapter, ex.queue.demand, popularity)
        if victim is None:
            return False
        need = num_pages - len(victim.pages if victim.state is SlotState.READY else ())
        return self.memory.evictions_for(ex, need, victim, popularity) is not None

    def pages_of(self, ex: ExecutorState, req: Request) -> int:
        """The pages req's adapter takes on ex."""
        return self.memory.pages_for(ex, req.adapter, req.adapter_ranks)

    def _popularity(self, ex: ExecutorState) -> Callable[[AdapterRef], float]:
        now = self.clock()
        return lambda adapter: ex.popularity.value(adapter, now)

    @staticmethod
    def fetching_since(ex: ExecutorState, adapter: AdapterRef) -> float | None:
        """Since when `adapter` is being fetched onto ex (a staging or a load under way, or
        failing and backing off), if it is."""
        return ex.fetching_since.get(adapter)

    @staticmethod
    def waits_on_a_failing_load(ex: ExecutorState, req: Request | None) -> bool:
        """Its adapter's fetches on ex failed and none has succeeded since (a retry may be under
        way: it fails as long as the outage lasts)."""
        return req is not None and req.adapter is not None and req.adapter in ex.load_failures

    # ---- bringing adapters in --------------------------------------------------------------
    def bring_closer(self, ex: ExecutorState, req: Request) -> None:
        """req was just queued on ex: prefetch its adapter; when that is not on its way (its
        loads back off), have the store bring it into RAM meanwhile, so that the next try does
        not wait on S3."""
        if (req.adapter and ex.slots.find(req.adapter) is None and not self.prefetch(ex, req)
                and ex.slots.staged(req.adapter) is None):
            self._warm_host(req.adapter)

    def prefetch(self, ex: ExecutorState, req: Request) -> bool:
        """Bring req's adapter onto ex ahead of its admission, unless its last failed fetch is
        too recent (backoff); its tenant pays for the fetch it causes. True when a slot was
        claimed for it (see bring_in)."""
        failure = ex.load_failures.get(req.adapter)
        if failure is not None and failure.retry_at > self.clock():
            return False
        slots = ex.slots
        is_new = slots.staged(req.adapter) is None and slots.find(req.adapter) is None
        if is_new and not req.caused_load:  # (once per request, not per retry of a failed fetch)
            req.caused_load = True
            self._charge_load(req, ex)
        return self.bring_in(ex, req.adapter, req.adapter_bytes,
                             self.pages_of(ex, req)) is not None

    def bring_in(self, ex: ExecutorState, adapter: AdapterRef, num_bytes: int,
                 num_pages: int = 0) -> Slot | None:
        """Start bringing `adapter` (of `num_bytes`, taking `num_pages` pages) onto ex, stage
        before evict: at once into an empty slot and free pages; giving up another adapter only
        once its bytes are staged on ex's host, starting the staging when it is not. The slot
        claimed, if any."""
        slots = ex.slots
        staged = slots.staged(adapter)
        fits = slots.has_empty() and self.memory.free_for_pages(ex) >= num_pages
        if fits or (staged is not None and staged.staged_at is not None
                    and self.can_place(ex, adapter, num_pages)):
            return self._load_on(ex, adapter, num_bytes, num_pages)
        if staged is None:
            slots.begin_stage(adapter, num_bytes, num_pages)
            ex.fetching_since.setdefault(adapter, self.clock())
            self._start_stage(ex, adapter, num_bytes)
        return None

    def _load_on(self, ex: ExecutorState, adapter: AdapterRef, num_bytes: int,
                 num_pages: int = 0) -> Slot | None:
        """Claim a slot of ex for `adapter` and its pages, evicting what must go, and start
        loading it there; None, with nothing changed, when no slot or not enough pages can be
        had (the caller checked it can: an empty slot and free pages, or its bytes are staged
        and can_place). Everything is planned before anything changes: the slot claimed is the
        victim whose pages were counted, and the pages are there once the others are evicted."""
        popularity = self._popularity(ex)
        victim = ex.slots.victim(adapter, ex.queue.demand, popularity)
        if victim is None:
            return None
        own = victim.pages if victim.state is SlotState.READY else ()
        evictions = self.memory.evictions_for(ex, num_pages - len(own), victim, popularity)
        if evictions is None:
            return None
        for slot in evictions:
            self._evict(ex, slot)
        ex.slots.place(adapter, victim, num_bytes)
        ex.counters.adapter_evictions += bool(victim.evicted)
        if victim.evicted_pages:
            self._release_pages(ex, victim.evicted, victim.evicted_pages)
        if num_pages:
            pages = ex.blocks.take_pages(num_pages)
            if pages is None:  # (a bug in the plan above: nothing is left half-done)
                ex.slots.clear(victim)
                if victim.evicted is not None:
                    self._start_unload(ex, victim.index, victim.evicted)
                raise RuntimeError(f"{adapter}'s {num_pages} pages were counted on "
                                   f"{ex.address} but {ex.blocks.num_settled()} are settled")
            ex.slots.set_pages(victim, tuple(pages))
        ex.fetching_since.setdefault(adapter, self.clock())
        self._start_load(ex, victim)
        return victim

    def _evict(self, ex: ExecutorState, slot: Slot, by_operator: bool = False) -> None:
        """Free an unused adapter's slot and pages (for a load, for KV, or an operator's)."""
        adapter, pages = slot.adapter, slot.pages
        ex.slots.clear(slot)
        self._release_pages(ex, adapter, pages)
        ex.counters.adapter_evictions += not by_operator
        self._start_unload(ex, slot.index, adapter)

    @staticmethod
    def _release_pages(ex: ExecutorState, adapter: AdapterRef, pages: tuple[int, ...]) -> None:
        """An adapter that left ex gives its pages back, and its cached prefix blocks with them
        (its KV: useless without it)."""
        if pages:
            ex.blocks.give_back_pages(pages)
            ex.blocks.drop_cached_of(adapter)

    def make_kv_room(self, ex: ExecutorState, enough: Callable[[], bool],
                     wanted_too: bool = False, keep: AdapterRef | None = None) -> bool:
        """KV needs blocks: evict unused adapters (adapter_memory.py: with `wanted_too`, also
        those queued requests want; never `keep`) until `enough()`; whether it is."""
        popularity = self._popularity(ex)
        while not enough():
            victims = self.memory.kv_victims(ex, popularity, wanted_too, keep)
            if not victims:
                return False
            self._evict(ex, victims[0])
        return True

    def prepare_admission(self, ex: ExecutorState) -> None:
        """Before admitting on ex: reservations nobody waits for lapse, and a slot reserved for a
        staged adapter, once drained, takes it at once (its requests may no longer be any
        tenant's oldest, and nothing else would start the load)."""
        ex.slots.drop_reservations(ex.queue.demand)
        for slot in ex.slots.slots:
            adapter = slot.reserved_for
            if adapter is None or slot.pins or slot.state is not SlotState.READY:
                continue
            staged = ex.slots.staged(adapter)
            if staged is not None and staged.staged_at is not None:
                self._load_on(ex, adapter, staged.num_bytes, staged.num_pages)

    def bring_in_for_oldest(self, ex: ExecutorState, req: Request, may_reserve: bool) -> None:
        """req is its tenant's oldest request on ex, and nothing of its tenant can start there
        or req is starving (admission.py): prefetch its adapter, or, when `may_reserve` (the
        fairest tenant, or a starving request) and its bytes are staged, reserve a slot to
        drain, within max_reserved_slots."""
        slots = ex.slots
        if not req.adapter or slots.find(req.adapter) is not None:
            return
        staged = slots.staged(req.adapter)
        is_staged = staged is not None and staged.staged_at is not None
        if not self.prefetch(ex, req) and is_staged and may_reserve and \
                slots.num_reserved() < self.limits.max_reserved_slots:
            slots.reserve(req.adapter)

    # ---- pins ------------------------------------------------------------------------------
    @staticmethod
    def pin(ex: ExecutorState, slot: Slot, req: Request) -> None:
        """A sequence of req starts on ex in `slot` (a hit unless req caused the load)."""
        ex.slots.pin(slot)
        ex.counters.adapter_hits += not req.caused_load

    @staticmethod
    def unpin(ex: ExecutorState, seq: Sequence) -> None:
        """seq left ex's running set: its slot is unpinned once no step in flight has its rows
        (loads are not ordered with steps: an adapter loaded into the slot meanwhile would be
        read by them)."""
        if seq.slot is None:
            return
        if ex.steps.is_in_flight(seq):
            ex.unpin_later.append(seq)
        else:
            ex.slots.unpin(seq.slot)

    @staticmethod
    def unpin_answered(ex: ExecutorState) -> None:
        """A step was answered: the slots of sequences that left before it are free of it."""
        for seq in [s for s in ex.unpin_later if not ex.steps.is_in_flight(s)]:
            ex.unpin_later.remove(seq)  # (the step loop plans next: a freed slot is seen then)
            ex.slots.unpin(seq.slot)

    @staticmethod
    def hold(ex: ExecutorState, slot: Slot) -> None:
        """Pin `slot` for as long as an adapter is merged from it (merging.py)."""
        ex.slots.pin(slot)

    @staticmethod
    def let_go(ex: ExecutorState, slot: Slot) -> None:
        ex.slots.unpin(slot)

    # ---- loads and stagings ending ----------------------------------------------------------
    def on_load_done(self, ex: ExecutorState, slot: Slot, adapter: AdapterRef,
                     error: LoraplexError | None, num_bytes: int = 0,
                     seconds: float = 0.0) -> LoraplexError | None:
        """A load into `slot` ended; returns the error that fails the requests waiting for
        `adapter` on ex (a failure that is not worth a retry), if any."""
        if slot.adapter != adapter or slot.state is not SlotState.LOADING:
            return None  # the executor was lost or reset meanwhile
        if error is None:
            ex.slots.mark_ready(slot)
            ex.counters.adapter_loads += 1
            ex.rates.observe_load(num_bytes, seconds)
            ex.load_failures.pop(adapter, None)
            ex.fetching_since.pop(adapter, None)
            return None
        if isinstance(error, Aborted):  # its staged bytes were gone: the slot is as it was
            pages = slot.pages  # (nothing was written to them)
            ex.slots.give_back(slot)  # (staged again when wanted)
            if pages:
                ex.blocks.give_back_pages(pages)
            ex.fetching_since.pop(adapter, None)
            return None
        self._give_up_load(ex, slot)
        return self._fetch_failed(ex, adapter, error)

    def _give_up_load(self, ex: ExecutorState, slot: Slot) -> None:
        """The load into `slot` failed or was given up: the slot holds nothing. Its copy may
        outlive the RPC: its pages wait for the executor's word (an UnloadAdapter answered)."""
        if slot.pages:
            ex.slots.begin_cleaning(slot)
            self._start_unload(ex, slot.index, slot.adapter,
                               done=lambda is_done: self._cleaned(ex, slot, is_done))
        else:
            ex.slots.clear(slot)

    def abandon(self, ex: ExecutorState, adapter: AdapterRef) -> None:
        """A bug broke off bringing `adapter` onto ex midway: whatever was under way for it is
        given up whole (a load as a failed one, a staging as a failed one), so nothing stays
        LOADING or staging for good; it may be brought in again."""
        slot = ex.slots.find(adapter)
        if slot is not None and slot.state is SlotState.LOADING:
            self._give_up_load(ex, slot)
        ex.slots.stage_failed(adapter)
        ex.load_failures.pop(adapter, None)
        ex.fetching_since.pop(adapter, None)

    @staticmethod
    def _cleaned(ex: ExecutorState, slot: Slot, is_done: bool) -> None:
        """The UnloadAdapter of a failed load's slot answered: its pages are free (unless the
        executor was lost meanwhile: then everything was reset). Not answered, they stay out of
        use until the executor is back (a reset)."""
        if is_done and slot.state is SlotState.CLEANING:
            ex.blocks.give_back_pages(ex.slots.end_cleaning(slot))

    def on_stage_done(self, ex: ExecutorState, adapter: AdapterRef, error: LoraplexError | None,
                      num_bytes: int = 0, seconds: float = 0.0) -> LoraplexError | None:
        """Its bytes are on ex's host (or could not be fetched): it may take a slot now. Returns
        as on_load_done."""
        staged = ex.slots.staged(adapter)
        if staged is None or staged.staged_at is not None:
            return None  # the executor was lost or reset meanwhile
        if error is not None:
            ex.slots.stage_failed(adapter)
            return self._fetch_failed(ex, adapter, error)
        ex.slots.mark_staged(adapter, self.clock())
        ex.rates.observe_load(num_bytes, seconds)
        ex.load_failures.pop(adapter, None)
        if self._load_on(ex, adapter, staged.num_bytes, staged.num_pages) is None:
            ex.fetching_since.pop(adapter, None)  # its bytes are here: it waits for a slot
        return None

    def _fetch_failed(self, ex: ExecutorState, adapter: AdapterRef,
                      error: LoraplexError) -> LoraplexError | None:
        """A load or staging of `adapter` on ex failed: back off when it may succeed later (a
        store or S3 down or frozen: None), else the error."""
        if isinstance(error, Unavailable):  # (a downstream DEADLINE_EXCEEDED arrives as this)
            previous = ex.load_failures.get(adapter)
            count = previous.count + 1 if previous else 1
            backoff = min(self.limits.max_load_backoff_s,
                          self.limits.load_backoff_s * 2 ** (count - 1))
            ex.load_failures[adapter] = LoadFailure(count, self.clock() + backoff, error)
            log.warning("fetching %s onto %s failed (%d in a row), trying again in %.1fs: %s",
                        adapter, ex.address, count, backoff, error)
            return None
        ex.load_failures.pop(adapter, None)
        ex.fetching_since.pop(adapter, None)
        log.warning("fetching %s onto %s failed: %s", adapter, ex.address, error)
        return error

    def expire(self, ex: ExecutorState, now: float) -> bool:
        """The clock tick: staged bytes the executor has dropped are forgotten, failures nobody
        waits for are forgotten; whether a backoff just passed (a load may be tried again)."""
        ex.slots.drop_staged_before(now - STAGED_TTL_S)  # executors keep them a while only
        is_due = False
        for adapter, failure in list(ex.load_failures.items()):
            if adapter not in ex.queue.demand:
                del ex.load_failures[adapter]  # nobody waits for it here any more
                ex.fetching_since.pop(adapter, None)
            elif failure.retry_at <= now and not failure.is_due:
                failure.is_due = is_due = True  # its backoff just passed: try again
        return is_due

    @staticmethod
    def reset(ex: ExecutorState) -> None:
        """Ex was lost: its slots, stagings and deferred unpins are gone."""
        ex.unpin_later.clear()
        ex.fetching_since.clear()
        ex.slots.reset()

    # ---- operators --------------------------------------------------------------------------
    def prewarm(self, up: list[ExecutorState], adapter: AdapterRef, adapter_bytes: int,
                num_executors: int, pin: bool,
                ranks: Mapping[str, int] | None = None) -> list[ExecutorState]:
        """Make `adapter` (with these per-module ranks) resident on `num_executors` of `up`
        (those already holding it count), choosing the least loaded others; with `pin`, LRU
        never takes those slots back."""
        holding = [ex for ex in up if ex.slots.find(adapter)]
        others = sorted((ex for ex in up if ex not in holding),
                        key=lambda ex: score(ex.work_tokens, ex.rates, False, True, adapter_bytes,
                                             0.0))
        chosen = holding + others[:max(0, num_executors - len(holding))]
        for ex in chosen:
            pages = self.memory.pages_for(ex, adapter, ranks)
            if ex.slots.find(adapter) is None and not self.can_place(ex, adapter, pages):
                raise FailedPrecondition(f"executor {ex.address}: every adapter slot is pinned "
                                         f"or no pages can be freed for it; evict or unpin one "
                                         f"before pre-warming {adapter}")
            if pin:
                self._check_pin(ex, adapter)
        for ex in chosen:
            slots = ex.slots
            # (staged first when it must evict another: then no slot is claimed yet)
            slot = slots.find(adapter) or self.bring_in(
                ex, adapter, adapter_bytes, self.memory.pages_for(ex, adapter, ranks))
            if pin and slot is not None:
                slots.pin_by_admin(slot)
            elif pin:
                slots.pin_by_admin_when_loaded(adapter)
        return chosen

    def _check_pin(self, ex: ExecutorState, adapter: AdapterRef) -> None:
        """FAILED_PRECONDITION when pinning `adapter` on ex would leave fewer than
        unpinned_slots of its slots to the other adapters."""
        pinned = ex.slots.admin_pinned()
        most = len(ex.slots.slots) - self.limits.unpinned_slots
        if adapter not in pinned and len(pinned) >= most:
            raise FailedPrecondition(
                f"executor {ex.address}: {len(pinned)} of its {len(ex.slots.slots)} adapter slots "
                f"are pinned, the most it allows (--unpinned-slots {self.limits.unpinned_slots} "
                f"stay for every other adapter); evict a pinned adapter before pinning {adapter}, "
                "or pre-warm it without pin")

    def evict(self, targets: list[ExecutorState], adapter: AdapterRef) -> int:
        """Free the slots holding `adapter` on `targets`; refused while it runs or loads."""
        slots = [(ex, ex.slots.find(adapter)) for ex in targets if ex.slots.find(adapter)]
        for ex, slot in slots:
            if slot.pins or slot.state is SlotState.LOADING:
                what = (f"{slot.pins} running sequences use it" if slot.pins
                        else "it is still loading")
                raise FailedPrecondition(f"cannot evict {adapter} from {ex.address}: {what}; "
                                         "retry later")
        for ex, slot in slots:
            self._evict(ex, slot, by_operator=True)
        return len(slots)
