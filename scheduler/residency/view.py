"""What the other managers may ask of one executor's adapter residency (executor_residency.py is
what they tell it): its state, held privately, and the questions (`holds`, `serves`,
`admissible`, `is_bringing_in`, `can_place`, `pages_of`, `keeps_wanted_idle`, ...)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping

from common.adapter_pages import PageGeometry
from common.adapter_ref import AdapterRef
from scheduler.executor_state import ExecutorState
from scheduler.request import Request
from scheduler.residency import adapter_memory
from scheduler.residency.fetches import Fetches, LoadFailure
from scheduler.residency.hooks import AdapterCounters, Hooks
from scheduler.residency.slots import Slot, SlotState, SlotStats, SlotTable


class ResidencyView:
    """One executor's residency state, and what the others may ask of it (the writer:
    ExecutorResidency)."""

    def __init__(self, ex: ExecutorState, num_slots: int, geometry: PageGeometry | None,
                 page_bytes: int, counters: AdapterCounters, hooks: Hooks):
        self._ex, self._hooks = ex, hooks
        self._slots = SlotTable(num_slots)
        self._pages, self._page_bytes = adapter_memory.AdapterPages(geometry), page_bytes
        self._fetches = Fetches(hooks.limits, hooks.clock, ex.address)
        self._counters = counters
        # Its last admission started nobody while it ran nothing and brought nothing in: a load
        # then leaves no KV for the requests queued ahead (they could not start either).
        self._is_stalled = False

    def holds(self, adapter: AdapterRef) -> bool:
        """A slot holds `adapter` or is loading it."""
        return self._slots.find(adapter) is not None

    def serves(self, adapter: AdapterRef | None) -> bool:
        """A new sequence of `adapter` (None: the base model) may start here now or once its load
        ends: its slot is READY and reserved for no other adapter, or LOADING."""
        slot = self._slots.find(adapter) if adapter else None
        return adapter is None or slot is not None and (
            slot.state is SlotState.LOADING or not slot.reserved_for)

    def pages_kv_cannot_take(self) -> int:
        """Pages of slots reserved for a load or pinned by an operator: no sequence's KV may
        take them until that load comes, or ever."""
        return sum(len(s.pages) for s in self._slots.slots if s.reserved_for or s.is_admin_pinned)

    def ready_slot(self, adapter: AdapterRef) -> int | None:
        """The slot holding `adapter` READY, if any."""
        slot = self._slots.find(adapter)
        return slot.index if slot is not None and slot.state is SlotState.READY else None

    def adapter_in(self, index: int) -> AdapterRef | None:
        return self._slots.slots[index].adapter

    def admissible(self) -> list[AdapterRef]:
        """The adapters a new sequence may run with now (READY, their slots not reserved)."""
        return [slot.adapter for slot in self._slots.admissible()]

    def is_staged(self, adapter: AdapterRef) -> bool:
        """Its bytes are staged on the host, or being staged."""
        return self._slots.staged(adapter) is not None

    def is_bringing_in(self) -> bool:
        """A load into a slot, or a staging onto the host, is under way."""
        return self._slots.is_bringing_in()

    def fetching_since(self, adapter: AdapterRef | None) -> float | None:
        """Since when `adapter` is being fetched here (a staging or a load under way, or failing
        and backing off), if it is."""
        return self._fetches.since(adapter)

    def load_failure(self, adapter: AdapterRef | None) -> LoadFailure | None:
        return self._fetches.failure(adapter)

    def has_failing_loads(self) -> bool:
        return self._fetches.has_failures()

    def waits_on_a_failing_load(self, req: Request | None) -> bool:
        """Its adapter's fetches here failed and none has succeeded since (a retry may be under
        way: it fails as long as the outage lasts)."""
        return req is not None and req.ask.adapter is not None \
            and self._fetches.failure(req.ask.adapter) is not None

    def pages_for(self, adapter: AdapterRef | None, ranks: Mapping[str, int] | None) -> int:
        """Pages `adapter` (with these per-module ranks) takes here."""
        return self._pages.of(adapter, ranks)

    def planned_pages(self) -> dict[AdapterRef, int]:
        """The pages of every adapter planned here so far."""
        return self._pages.all_planned()

    def pages_of(self, req: Request) -> int:
        """The pages req's adapter takes here."""
        return self.pages_for(req.ask.adapter, req.ask.adapter_ranks)

    def can_place(self, adapter: AdapterRef, num_pages: int = 0) -> bool:
        """A slot could take `adapter` now (an empty one, or one nobody pins or wants), and its
        `num_pages` pages could be found (adapter_memory.py)."""
        popularity, wanted = self._popularity(), self._hooks.wanted(self._ex)
        victim = self._slots.victim(adapter, wanted, popularity)
        if victim is None:
            return False
        need = num_pages - len(victim.pages if victim.state is SlotState.READY else ())
        return adapter_memory.evictions_for(self._slots, need, self._free_for_pages(adapter),
                                            victim, wanted, popularity) is not None

    def keeps_wanted_idle(self) -> bool:
        """Adapters that queued requests want sit in pages here, nothing running them: KV that
        takes their pages would have them loaded again for those requests (churn)."""
        return self._pages.is_paged and adapter_memory.has_wanted_idle(
            self._slots, self._hooks.wanted(self._ex))

    def could_never_load(self, adapter: AdapterRef) -> bool:
        """`adapter` is in no slot and every slot is pinned by an operator."""
        return not self.holds(adapter) and self._slots.are_all_admin_pinned()

    def counters(self) -> AdapterCounters:
        return dataclasses.replace(self._counters)

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    def slot_stats(self) -> tuple[SlotStats, ...]:
        return self._slots.stats()

    def when_loaded(self, adapter: AdapterRef, callback: Callable[[bool], None]) -> None:
        """Call `callback(is_ready)` once `adapter`'s load here ends (slots.py)."""
        self._slots.when_loaded(adapter, callback)

    def admin_pinned(self) -> set[AdapterRef]:
        """Adapters an operator pinned here, their slots pinned or to be once loaded."""
        return self._slots.admin_pinned()

    @property
    def num_slots(self) -> int:
        return len(self._slots.slots)

    @staticmethod
    def _is_early(slot: Slot) -> bool:
        """Its READY adapter, evicted now, has served nobody since its load
        (AdapterCounters.early_evictions)."""
        return not slot.uses

    def _free_for_pages(self, adapter: AdapterRef) -> int:
        """Blocks a load of `adapter` may take without evicting anyone (adapter_memory.py)."""
        if not self._pages.is_paged:
            return 0  # (its adapters take no pages)
        ahead = 0 if self._is_stalled else self._hooks.kv_ahead(self._ex, adapter)
        return adapter_memory.free_for_pages(self._ex.blocks, self._hooks.limits.kv_reserve,
                                             ahead)

    def _popularity(self) -> Callable[[AdapterRef], float]:
        return self._hooks.popularity(self._ex, self._hooks.clock())

    # ---- for tests and the simulator --------------------------------------------------------
    def check(self, where: str, pins: Mapping[int, int], answered: int,
              running: Collection[int]) -> None:
        """Assert its bookkeeping (slots.py: SlotTable.check)."""
        self._slots.check(where, pins, answered, running,
                          self._pages.planned if self._pages.is_paged else None,
                          self._ex.blocks.num_pages)
