"""One executor's adapter residency (residency.py states the policy): which adapter each of its
slots holds, which adapters are staged on its host, the pages each takes there (adapter_memory.py),
the fetches under way or failing (fetches.py), the unpins that wait for steps in flight, and its
counters. All of it private: the other managers ask (`holds`, `admissible`, `is_bringing_in`,
`can_place`, `pages_of`, ...: view.py) and tell (`bring_in`, `pin`, `unpin`, `make_kv_room`,
...: here).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from common.adapter_ref import AdapterRef
from common.errors import Aborted, FailedPrecondition, LoraplexError
from scheduler.request import Request
from scheduler.residency import adapter_memory
from scheduler.residency.hooks import Load
from scheduler.residency.slots import Slot, SlotState
from scheduler.residency.view import ResidencyView

# An adapter staged on an executor and not taken into a slot within this long is staged again
# when wanted (executors drop staged bytes after EXECUTOR_STAGED_TTL_S, which is longer).
STAGED_TTL_S = 60.0


class ExecutorResidency(ResidencyView):
    """What the other managers tell an executor's residency (what they ask: view.py)."""

    # ---- bringing adapters in ---------------------------------------------------------------
    def bring_closer(self, req: Request) -> None:
        """req was just queued here: prefetch its adapter; when that is not on its way (its
        loads back off), have the store bring it into RAM meanwhile, so that the next try does
        not wait on S3."""
        adapter = req.ask.adapter
        if (adapter and self._slots.find(adapter) is None and not self._prefetch(req)
                and self._slots.staged(adapter) is None):
            self._hooks.warm_host(adapter)

    def bring_in(self, adapter: AdapterRef, num_bytes: int,
                 ranks: Mapping[str, int] | None) -> int | None:
        """Start bringing `adapter` (of `num_bytes`, with these ranks) here, stage before evict
        (`_bring_in`); the slot claimed, if any."""
        slot = self._bring_in(adapter, num_bytes, self.pages_for(adapter, ranks))
        return None if slot is None else slot.index

    def bring_in_for_oldest(self, req: Request, may_reserve: bool) -> None:
        """req is its tenant's oldest request here, and nothing of its tenant can start or req
        is starving (admission.py): prefetch its adapter, or, when `may_reserve` (the fairest
        tenant, or a starving request) and its bytes are staged, reserve a slot to drain,
        within max_reserved_slots."""
        slots, adapter = self._slots, req.ask.adapter
        if not adapter or slots.find(adapter) is not None:
            return
        staged = slots.staged(adapter)
        is_staged = staged is not None and staged.staged_at is not None
        if not self._prefetch(req) and is_staged and may_reserve and \
                slots.num_reserved() < self._hooks.limits.max_reserved_slots:
            slots.reserve(adapter)

    def admitted(self, started_anyone: bool, was_idle: bool) -> None:
        """An admission pass ended: whether it started anyone, and whether ex ran nothing and
        brought nothing in (view.py: stalled, a load leaves no KV for the requests ahead: the
        liveness of every wait for a load under adapter pressure, whatever held it back)."""
        self._is_stalled = was_idle and not started_anyone

    def prepare_admission(self) -> None:
        """Before admitting: reservations nobody waits for lapse, and a slot reserved for a
        staged adapter, once drained, takes it at once (its requests may no longer be any
        tenant's oldest, and nothing else would start the load)."""
        wanted = self._hooks.wanted(self._ex)
        self._slots.drop_reservations(wanted)
        for slot in self._slots.slots:
            adapter = slot.reserved_for
            if adapter is None or slot.pins or slot.state is not SlotState.READY:
                continue
            staged = self._slots.staged(adapter)
            if staged is not None and staged.staged_at is not None:
                self._load_on(adapter, staged.num_bytes, staged.num_pages)
        if self._pages.is_paged:
            self._load_staged(wanted)

    def _load_staged(self, wanted: Collection[AdapterRef | None]) -> None:
        """Adapters in pages: those staged here that queued requests want and no slot took yet
        (pages were short when their bytes came) take slots as soon as they can, in the order
        they were staged: a wave's adapters load as the one before leaves, each once. The first
        that cannot holds the others back (they would take what it waits for)."""
        for adapter, staged in self._slots.waiting_staged():
            if adapter not in wanted:
                continue
            if not self.can_place(adapter, staged.num_pages) or self._load_on(
                    adapter, staged.num_bytes, staged.num_pages) is None:
                return

    def make_kv_room(self, enough: Callable[[], bool], wanted_too: bool = False,
                     keep: AdapterRef | None = None, reserved_too: bool = False) -> bool:
        """KV needs blocks: evict unused adapters (adapter_memory.py: with `wanted_too`, also
        those queued requests want, with `reserved_too` slots reserved for another; never
        `keep`) until `enough()`; whether it is."""
        popularity = self._popularity()
        while not enough():
            victims = [] if not self._pages.is_paged else adapter_memory.kv_victims(
                self._slots, self._hooks.wanted(self._ex), popularity, wanted_too, keep,
                reserved_too)
            if not victims:
                return False
            self._evict(victims[0])
        return True

    def _prefetch(self, req: Request) -> bool:
        """Bring req's adapter here ahead of its admission, unless its last failed fetch is too
        recent (backoff); its tenant pays for the fetch it causes. True when a slot was claimed
        for it (see _bring_in)."""
        adapter = req.ask.adapter
        if self._fetches.is_backing_off(adapter):
            return False
        if self._slots.staged(adapter) is None and self._slots.find(adapter) is None:
            self._hooks.charge_load(req, self._ex)  # (once per request: Admission)
        return self._bring_in(adapter, req.ask.adapter_bytes, self.pages_of(req)) is not None

    def _bring_in(self, adapter: AdapterRef, num_bytes: int, num_pages: int = 0) -> Slot | None:
        """At once into an empty slot and free pages; giving up another adapter only once its
        bytes are staged on the host, starting the staging when it is not. The slot claimed."""
        slots = self._slots
        staged = slots.staged(adapter)
        fits = slots.has_empty() and self._free_for_pages(adapter) >= num_pages
        if fits or (staged is not None and staged.staged_at is not None
                    and self.can_place(adapter, num_pages)):
            return self._load_on(adapter, num_bytes, num_pages)
        if staged is None:
            slots.begin_stage(adapter, num_bytes, num_pages)
            self._fetches.begin(adapter)
            self._hooks.start_stage(self._ex, adapter, num_bytes)
        return None

    def _load_on(self, adapter: AdapterRef, num_bytes: int, num_pages: int = 0) -> Slot | None:
        """Claim a slot for `adapter` and its pages, evicting what must go, and start loading it
        there; None, with nothing changed, when no slot or not enough pages can be had (the
        caller checked it can: an empty slot and free pages, or its bytes are staged and
        can_place). Everything is planned before anything changes: the slot claimed is the
        victim whose pages were counted, and the pages are there once the others are evicted."""
        popularity, wanted = self._popularity(), self._hooks.wanted(self._ex)
        victim = self._slots.victim(adapter, wanted, popularity)
        if victim is None:
            return None
        own = victim.pages if victim.state is SlotState.READY else ()
        evictions = adapter_memory.evictions_for(self._slots, num_pages - len(own),
                                                 self._free_for_pages(adapter), victim, wanted,
                                                 popularity)
        if evictions is None:
            return None
        for slot in evictions:
            self._evict(slot)
        is_early = victim.state is SlotState.READY and self._is_early(victim)
        self._slots.place(adapter, victim, num_bytes)
        self._counters.evictions += bool(victim.evicted)
        self._counters.early_evictions += is_early
        if victim.evicted_pages:
            self._release_pages(victim.evicted, victim.evicted_pages)
        blocks = self._ex.blocks
        if num_pages:
            pages = blocks.take_pages(num_pages)
            if pages is None:  # (a bug in the plan above: nothing is left half-done)
                self._slots.clear(victim)
                if victim.evicted is not None:
                    self._hooks.start_unload(self._ex, victim.index, victim.evicted)
                raise RuntimeError(f"{adapter}'s {num_pages} pages were counted on "
                                   f"{self._ex.address} but {blocks.num_settled()} are settled")
            self._slots.set_pages(victim, tuple(pages))
        self._fetches.begin(adapter)
        self._hooks.start_load(self._ex, Load(victim.index, adapter, victim.num_bytes,
                                              victim.pages, victim.is_from_staged))
        return victim

    def _evict(self, slot: Slot, by_operator: bool = False) -> None:
        """Free an unused adapter's slot and pages (for a load, for KV, or an operator's)."""
        adapter, pages = slot.adapter, slot.pages
        self._counters.early_evictions += not by_operator and self._is_early(slot)
        self._slots.clear(slot)
        self._release_pages(adapter, pages)
        self._counters.evictions += not by_operator
        self._hooks.start_unload(self._ex, slot.index, adapter)

    def _release_pages(self, adapter: AdapterRef, pages: tuple[int, ...]) -> None:
        """An adapter that left gives its pages back, and its cached prefix blocks with them
        (its KV: useless without it)."""
        if pages:
            self._ex.blocks.give_back_pages(pages)
            self._ex.blocks.drop_cached_of(adapter)

    # ---- pins -------------------------------------------------------------------------------
    def pin(self, req: Request) -> int:
        """A sequence of req starts with its adapter, READY here (a hit unless req caused the
        load): its slot."""
        slot = self._slots.find(req.ask.adapter)
        self._slots.pin(slot)
        self._counters.hits += not req.charges.caused_load
        return slot.index

    def unpin(self, seq_id: int, index: int, last_step: int, answered: int) -> None:
        """Sequence `seq_id` left the running set: its slot `index` is unpinned once no step in
        flight has its rows (once `last_step`, its last, is answered; `answered` is now)."""
        self._slots.unpin_after(seq_id, index, last_step, answered)

    def unpin_answered(self, answered: int) -> None:
        """Every step up to `answered` is answered: slots wait for none of them any more."""
        self._slots.answered(answered)

    def hold(self, index: int) -> None:
        """Pin slot `index` for as long as an adapter is merged from it (merging.py)."""
        self._slots.pin(self._slots.slots[index])

    def let_go(self, index: int) -> None:
        self._slots.unpin(self._slots.slots[index])

    # ---- loads and stagings ending ----------------------------------------------------------
    def on_load_done(self, load: Load, error: LoraplexError | None, num_bytes: int = 0,
                     seconds: float = 0.0) -> LoraplexError | None:
        """`load` ended; returns the error that fails the requests waiting for its adapter here
        (a failure that is not worth a retry), if any."""
        slot, adapter = self._slots.slots[load.slot], load.adapter
        if slot.adapter != adapter or slot.state is not SlotState.LOADING:
            return None  # the executor was lost or reset meanwhile
        if error is None:
            self._slots.mark_ready(slot)
            self._counters.loads += 1
            self._hooks.observe_load(self._ex, num_bytes, seconds)
            self._fetches.forget(adapter)
            return None
        if isinstance(error, Aborted):  # its staged bytes were gone: the slot is as it was
            pages = slot.pages  # (nothing was written to them)
            self._slots.give_back(slot)  # (staged again when wanted)
            if pages:
                self._ex.blocks.give_back_pages(pages)
            self._fetches.end(adapter)
            return None
        self._give_up_load(slot)
        return self._fetches.failed(adapter, error)

    def on_stage_done(self, adapter: AdapterRef, error: LoraplexError | None,
                      num_bytes: int = 0, seconds: float = 0.0) -> LoraplexError | None:
        """Its bytes are on the host (or could not be fetched): it may take a slot now. Returns
        as on_load_done."""
        staged = self._slots.staged(adapter)
        if staged is None or staged.staged_at is not None:
            return None  # the executor was lost or reset meanwhile
        if error is not None:
            self._slots.stage_failed(adapter)
            return self._fetches.failed(adapter, error)
        self._slots.mark_staged(adapter, self._hooks.clock())
        self._hooks.observe_load(self._ex, num_bytes, seconds)
        self._fetches.came(adapter)
        if self._load_on(adapter, staged.num_bytes, staged.num_pages) is None:
            self._fetches.end(adapter)  # its bytes are here: it waits for a slot
        return None

    def abandon(self, adapter: AdapterRef) -> None:
        """A bug broke off bringing `adapter` here midway: whatever was under way for it is
        given up whole (a load as a failed one, a staging as a failed one), so nothing stays
        LOADING or staging for good; it may be brought in again."""
        slot = self._slots.find(adapter)
        if slot is not None and slot.state is SlotState.LOADING:
            self._give_up_load(slot)
        self._slots.stage_failed(adapter)
        self._fetches.forget(adapter)

    def _give_up_load(self, slot: Slot) -> None:
        """The load into `slot` failed or was given up: the slot holds nothing. Its copy may
        outlive the RPC: its pages wait for the executor's word (an UnloadAdapter answered)."""
        if slot.pages:
            self._slots.begin_cleaning(slot)
            self._hooks.start_unload(self._ex, slot.index, slot.adapter,
                                     done=lambda is_done: self._cleaned(slot, is_done))
        else:
            self._slots.clear(slot)

    def _cleaned(self, slot: Slot, is_done: bool) -> None:
        """The UnloadAdapter of a failed load's slot answered: its pages are free (unless the
        executor was lost meanwhile: then everything was reset). Not answered, they stay out of
        use until the executor is back (a reset)."""
        if is_done and slot.state is SlotState.CLEANING:
            self._ex.blocks.give_back_pages(self._slots.end_cleaning(slot))

    def expire(self, now: float) -> bool:
        """The clock tick: staged bytes the executor has dropped are forgotten, failures nobody
        waits for are forgotten; whether a backoff just passed (a load may be tried again)."""
        self._slots.drop_staged_before(now - STAGED_TTL_S)  # executors keep them a while only
        return self._fetches.expire(self._hooks.wanted(self._ex), now)

    def reset(self) -> None:
        """The executor was lost: its slots, stagings and deferred unpins are gone."""
        self._fetches.reset()
        self._slots.reset()

    # ---- operators --------------------------------------------------------------------------
    def pin_by_operator(self, adapter: AdapterRef) -> None:
        self._slots.pin_by_operator(adapter)

    def check_evict(self, adapter: AdapterRef) -> None:
        """FAILED_PRECONDITION while `adapter` runs or loads here."""
        slot = self._slots.find(adapter)
        if slot is not None and (slot.pins or slot.state is SlotState.LOADING):
            what = (f"{slot.pins} running sequences use it" if slot.pins
                    else "it is still loading")
            raise FailedPrecondition(f"cannot evict {adapter} from {self._ex.address}: {what}; "
                                     "retry later")

    def evict(self, adapter: AdapterRef) -> None:
        """An operator frees `adapter`'s slot (check_evict first)."""
        self._evict(self._slots.find(adapter), by_operator=True)
