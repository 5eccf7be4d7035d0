"""Adapter residency on one executor: which adapter each GPU slot holds, and who pins it.

A slot is EMPTY, LOADING or READY. Running sequences pin the slot of their adapter for their whole
life; a pinned slot is never evicted, nor is one an operator pinned (pre-warm with pin). Among the
other READY slots the least popular one (decayed request counts, routing.Popularity; LRU among
equals) that no queued request wants is given up when a new adapter needs room; a wanted adapter is
never evicted to prefetch another.

Stage before evict: an adapter goes into an EMPTY slot at once, but takes the slot of another
adapter only once its bytes are STAGED on the executor's host (fetched from a store, checked,
parsed; the StageAdapter RPC). A READY adapter is never given up for bytes that are not there yet,
so a frozen store or S3 costs only the requests waiting for the cold adapter.

When every slot is pinned, the fairest waiting request whose adapter is staged, or one that has
waited starvation_wait_s (admission.py), may RESERVE one (the least pinned, then least recently
used): no new sequence is admitted onto a reserved slot, so it drains and goes to that request's
adapter. This bounds how long a cold adapter can wait under sustained load.

SlotTable is the only writer of slot fields. Whoever waits for a load (a pre-warm) is told when
the slot leaves LOADING: READY, or cleared (the load or its staging failed, the executor went
away).
"""

import collections
import enum
import itertools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from common.adapter_ref import AdapterRef


class SlotState(enum.Enum):
    EMPTY = "empty"
    LOADING = "loading"
    READY = "ready"
    # A load that failed, its pages held until the executor says nothing writes them any more
    # (an UnloadAdapter answered): they are KV blocks (adapter_memory.py), and a load's copy may
    # still run after its RPC gave up.
    CLEANING = "cleaning"


@dataclass(eq=False)
class Slot:
    index: int
    state: SlotState = SlotState.EMPTY
    adapter: AdapterRef | None = None  # while LOADING or READY
    pins: int = 0  # running sequences using it
    last_used: int = 0  # logical clock, for LRU
    is_admin_pinned: bool = False  # pre-warmed with pin: evicted only by an operator
    reserved_for: AdapterRef | None = None  # adapter waiting for this slot to drain
    uses: int = 0  # sequences that pinned it since it became ready
    evicted: AdapterRef | None = None  # the adapter its last placement replaced
    num_bytes: int = 0  # size of its adapter's weights (sizes a load's deadline)
    is_from_staged: bool = False  # its load copies bytes already staged on the host
    pages: tuple[int, ...] = ()  # the KV blocks its adapter's weights are in (no pages: none)
    evicted_pages: tuple[int, ...] = ()  # the pages of the adapter its last placement replaced


@dataclass(frozen=True)
class SlotStats:
    """A slot as the Stats RPC reports it."""

    adapter: AdapterRef | None
    state: SlotState
    pins: int
    is_admin_pinned: bool
    reserved_for: AdapterRef | None
    num_pages: int = 0
    pages: tuple[int, ...] = ()  # (the KV blocks its adapter's weights are in)


@dataclass
class Staged:
    """An adapter whose bytes are being fetched onto the executor's host, or are there (checked
    and parsed) waiting for a slot, which no READY adapter gives up before they are."""

    num_bytes: int
    num_pages: int = 0  # pages its weights will take here (adapter_memory.py)
    staged_at: float | None = None  # scheduler clock; None while the fetch runs


class SlotTable:
    def __init__(self, num_slots: int):
        self.slots = [Slot(i) for i in range(num_slots)]
        self._by_adapter: dict[AdapterRef, Slot] = {}
        self._staged: dict[AdapterRef, Staged] = {}
        self._clock = itertools.count(1)
        # adapter -> callbacks told whether its load ended READY
        self._waiters: dict[AdapterRef, list[Callable[[bool], None]]] = {}
        self._pins_promised: set[AdapterRef] = set()  # pinned by an operator once loaded
        # (seq id, slot index, last step) of sequences that left the running set while steps
        # with their rows were in flight: their slots stay pinned until those are answered
        # (loads are not ordered with steps: an adapter loaded into the slot meanwhile would be
        # read by them).
        self._unpin_later: list[tuple[int, int, int]] = []

    def find(self, adapter: AdapterRef) -> Slot | None:
        """The slot holding or loading `adapter`, if any."""
        return self._by_adapter.get(adapter)

    def victim(self, adapter: AdapterRef, wanted: Collection[AdapterRef | None] = frozenset(),
               popularity: Callable[[AdapterRef], float] | None = None) -> Slot | None:
        """The slot to claim for `adapter` (None: none can take it): its reserved slot once
        drained, else an empty one, else the unpinned one whose adapter no queued request wants
        and is least popular (least recently used among equals; plain LRU without
        `popularity`)."""
        return self._victim(adapter, wanted, popularity)

    def place(self, adapter: AdapterRef, slot: Slot, num_bytes: int = 0,
              pages: tuple[int, ...] = ()) -> None:
        """Claim `slot` (the one `victim` gave for `adapter`) for loading `adapter` into `pages`.
        The replaced adapter's pages are its `evicted_pages`."""
        if slot.pins or slot.state not in (SlotState.EMPTY, SlotState.READY):
            raise RuntimeError(f"slot {slot.index} is {slot.state.value} with {slot.pins} pins: "
                               f"it cannot take {adapter}")
        self._by_adapter.pop(slot.adapter, None)
        slot.evicted, slot.evicted_pages = slot.adapter, slot.pages
        slot.state, slot.adapter, slot.pins = SlotState.LOADING, adapter, 0
        slot.num_bytes, slot.pages = num_bytes, pages
        staged = self._staged.pop(adapter, None)  # its bytes go into the slot now
        slot.is_from_staged = staged is not None and staged.staged_at is not None
        slot.is_admin_pinned, slot.reserved_for = False, None
        for other in self.slots:  # a reservation elsewhere for it is moot now
            if other.reserved_for == adapter:
                other.reserved_for = None
        self._by_adapter[adapter] = slot

    def admissible(self) -> list[Slot]:
        """Slots a new sequence may pin now."""
        return [s for s in self.slots if s.state is SlotState.READY and not s.reserved_for]

    def reserve(self, adapter: AdapterRef) -> Slot | None:
        """Reserve the least pinned, least recently used slot for `adapter`, unless one already is.
        A slot whose adapter has not served anyone since it loaded is left alone: taking it before
        its waiting requests ran would let two adapters take turns loading forever."""
        if any(s.reserved_for == adapter for s in self.slots):
            return None
        free = [s for s in self.slots if s.state is SlotState.READY and not s.reserved_for
                and not s.is_admin_pinned and s.uses]
        slot = min(free, key=lambda s: (s.pins, s.last_used), default=None)
        if slot is not None:
            slot.reserved_for = adapter
        return slot

    def evictable(self, wanted: Collection[AdapterRef | None],
                  popularity: Callable[[AdapterRef], float],
                  reserved_too: bool = False) -> list[Slot]:
        """READY slots whose adapter may go (nobody runs, pins, reserves or waits for it; with
        `reserved_too`, also one reserved for another), the least popular first (least recently
        used among equals)."""
        cold = [s for s in self.slots if s.state is SlotState.READY and s.pins == 0
                and not s.is_admin_pinned and (reserved_too or not s.reserved_for)
                and s.adapter not in wanted]
        return sorted(cold, key=lambda s: (popularity(s.adapter), s.last_used))

    def has_empty(self) -> bool:
        """A slot that holds nothing and waits for nobody: a load into it gives up no adapter."""
        return any(s.state is SlotState.EMPTY and not s.reserved_for for s in self.slots)

    # ---- staging: an adapter's bytes onto the executor's host before it may take a slot ----
    def staged(self, adapter: AdapterRef) -> Staged | None:
        return self._staged.get(adapter)

    def waiting_staged(self) -> list[tuple[AdapterRef, Staged]]:
        """Adapters staged on the host and in no slot yet, in the order their staging began."""
        return [(a, s) for a, s in self._staged.items() if s.staged_at is not None]

    def is_bringing_in(self) -> bool:
        """A load into a slot, or a staging onto the host, is under way."""
        return (any(s.state is SlotState.LOADING for s in self.slots)
                or any(s.staged_at is None for s in self._staged.values()))

    def begin_stage(self, adapter: AdapterRef, num_bytes: int, num_pages: int = 0) -> None:
        self._staged[adapter] = Staged(num_bytes, num_pages)

    def mark_staged(self, adapter: AdapterRef, now: float) -> None:
        self._staged[adapter].staged_at = now

    def stage_failed(self, adapter: AdapterRef) -> None:
        """Its staged bytes are gone (or never came): a slot reserved for it serves again."""
        self._staged.pop(adapter, None)
        for slot in self.slots:
            if slot.reserved_for == adapter:
                slot.reserved_for = None
        if self.find(adapter) is None:
            self._notify(adapter, False)

    def drop_staged_before(self, since: float) -> None:
        """Forget adapters staged before `since` that no slot took (the executor drops them)."""
        for adapter in [a for a, s in self._staged.items()
                        if s.staged_at is not None and s.staged_at < since]:
            self.stage_failed(adapter)

    def are_all_admin_pinned(self) -> bool:
        """Every slot pinned by an operator: no other adapter can ever be loaded here."""
        return all(s.is_admin_pinned for s in self.slots)

    def num_reserved(self) -> int:
        return sum(1 for s in self.slots if s.reserved_for)

    def drop_reservations(self, wanted: Collection[AdapterRef | None]) -> None:
        """A reservation lapses when nobody waits for its adapter any more."""
        for slot in self.slots:
            if slot.reserved_for and slot.reserved_for not in wanted:
                slot.reserved_for = None

    def pin_by_operator(self, adapter: AdapterRef) -> None:
        """An operator pinned `adapter`: LRU never takes its slot back (once it is loaded, when
        no slot holds it yet: its bytes are being staged)."""
        slot = self.find(adapter)
        if slot is not None:
            self.pin_by_admin(slot)
        else:
            self.pin_by_admin_when_loaded(adapter)

    def pin_by_admin(self, slot: Slot) -> None:
        """An operator pinned it (pre-warm with pin): only an operator's eviction frees it."""
        slot.is_admin_pinned = True

    def pin_by_admin_when_loaded(self, adapter: AdapterRef) -> None:
        """An operator pinned `adapter`, whose bytes are being staged (no slot is claimed yet):
        its slot is pinned once its load ends READY."""
        self._pins_promised.add(adapter)

        def loaded(is_ready: bool) -> None:
            self._pins_promised.discard(adapter)
            if is_ready:
                self.pin_by_admin(self.find(adapter))
        self.when_loaded(adapter, loaded)

    def admin_pinned(self) -> set[AdapterRef]:
        """Adapters an operator pinned here, their slots pinned or to be once loaded."""
        return {s.adapter for s in self.slots if s.is_admin_pinned} | self._pins_promised

    def when_loaded(self, adapter: AdapterRef, callback: Callable[[bool], None]) -> None:
        """Call `callback(is_ready)` once `adapter`'s load here ends: at once unless it is
        loading or staging (True when it is READY here, False when no slot holds it)."""
        slot = self.find(adapter)
        if (slot is not None and slot.state is SlotState.LOADING) or adapter in self._staged:
            self._waiters.setdefault(adapter, []).append(callback)
        else:
            callback(slot is not None)

    def mark_ready(self, slot: Slot) -> None:
        slot.state, slot.uses = SlotState.READY, 0
        slot.last_used = next(self._clock)
        self._notify(slot.adapter, True)

    def clear(self, slot: Slot) -> None:
        if slot.pins:
            raise RuntimeError(f"slot {slot.index} ({slot.adapter}) is pinned {slot.pins} times")
        adapter, was_loading = slot.adapter, slot.state is SlotState.LOADING
        self._by_adapter.pop(adapter, None)
        slot.state, slot.adapter, slot.pages = SlotState.EMPTY, None, ()
        slot.is_admin_pinned, slot.reserved_for = False, None
        if was_loading:
            self._notify(adapter, False)

    def set_pages(self, slot: Slot, pages: tuple[int, ...]) -> None:
        """The pages the adapter loading into `slot` is written to."""
        slot.pages = pages

    def begin_cleaning(self, slot: Slot) -> None:
        """Its load failed: the slot holds no adapter, its pages stay out of use until
        `end_cleaning` (SlotState.CLEANING)."""
        adapter = slot.adapter
        self._by_adapter.pop(adapter, None)
        slot.state, slot.is_admin_pinned, slot.reserved_for = SlotState.CLEANING, False, None
        self._notify(adapter, False)

    def end_cleaning(self, slot: Slot) -> tuple[int, ...]:
        """Nothing writes its pages any more: the slot is empty; its pages, to give back."""
        pages = slot.pages
        slot.state, slot.adapter, slot.pages = SlotState.EMPTY, None, ()
        return pages

    def give_back(self, slot: Slot) -> None:
        """A load from staged bytes that were gone did not happen: the slot still holds the
        adapter it held before (READY again), or is empty."""
        adapter, previous = slot.adapter, slot.evicted
        self._by_adapter.pop(adapter, None)
        slot.state, slot.adapter, slot.pages = SlotState.EMPTY, None, ()
        # (An adapter whose pages went back to the blocks when it was replaced cannot return.)
        if previous is not None and previous not in self._by_adapter and not slot.evicted_pages:
            slot.state, slot.adapter, slot.uses = SlotState.READY, previous, 0
            self._by_adapter[previous] = slot
        self._notify(adapter, False)

    def reset(self) -> None:
        """Forget everything (the executor went away)."""
        self._unpin_later.clear()
        for slot in self.slots:
            slot.pins = 0
            self.clear(slot)
            slot.evicted_pages = ()
        for adapter in list(self._staged):
            self.stage_failed(adapter)

    def pin(self, slot: Slot) -> None:
        if slot.state is not SlotState.READY:
            raise RuntimeError(f"slot {slot.index} is {slot.state.value}, cannot pin")
        slot.pins += 1
        slot.uses += 1
        slot.last_used = next(self._clock)

    def unpin(self, slot: Slot) -> None:
        if slot.pins <= 0:
            raise RuntimeError(f"slot {slot.index} unpinned more often than pinned")
        slot.pins -= 1
        slot.last_used = next(self._clock)

    def unpin_after(self, seq_id: int, index: int, last_step: int, answered: int) -> None:
        """Sequence `seq_id` left the running set: slot `index` is unpinned once no step in
        flight has its rows (once `last_step`, its last, is answered; `answered` is now)."""
        if last_step > answered:
            self._unpin_later.append((seq_id, index, last_step))
        else:
            self.unpin(self.slots[index])

    def answered(self, answered: int) -> None:
        """Every step up to `answered` is answered: the slots of sequences that left before are
        free of them (in the order they left)."""
        if not self._unpin_later:
            return
        done = [entry for entry in self._unpin_later if entry[2] <= answered]
        self._unpin_later = [entry for entry in self._unpin_later if entry[2] > answered]
        for _, index, _ in done:
            self.unpin(self.slots[index])

    def stats(self) -> tuple[SlotStats, ...]:
        return tuple(SlotStats(s.adapter, s.state, s.pins, s.is_admin_pinned, s.reserved_for,
                               len(s.pages), s.pages) for s in self.slots)

    def check(self, where: str, pins: Mapping[int, int], answered: int,
              running: Collection[int], num_pages: Callable[[AdapterRef], int] | None,
              num_page_blocks: int) -> None:
        """Assert the table's bookkeeping (tests, the simulator): each slot pinned as `pins`
        says (running sequences and merges) and by its deferred unpins (each of a sequence no
        longer `running`, for a step after `answered`), only READY ones pinned, an adapter in
        one slot (indexed), a page in one slot, each adapter in its `num_pages` (None: no
        pages), and as many pages in slots as the blocks hold (`num_page_blocks`)."""
        pins = collections.Counter(pins)
        for seq_id, index, last_step in self._unpin_later:
            assert last_step > answered and seq_id not in running, \
                f"{where}: seq {seq_id} kept its slot pinned for no step"
            pins[index] += 1
        held = collections.Counter(s.adapter for s in self.slots
                                   if s.adapter and s.state is not SlotState.CLEANING)
        assert all(n == 1 for n in held.values()), f"{where}: an adapter in two slots: {held}"
        pages: collections.Counter[int] = collections.Counter()
        for slot in self.slots:
            what = f"{where}: slot {slot.index}"
            assert slot.pins == pins[slot.index], f"{what} pins {slot.pins} != {pins[slot.index]}"
            assert slot.pins == 0 or slot.state is SlotState.READY, f"{what} pinned unready"
            assert (slot.state is SlotState.EMPTY) == (not slot.adapter), f"{what} state"
            if slot.adapter and slot.state is not SlotState.CLEANING:
                assert self.find(slot.adapter) is slot, f"{what}: index of {slot.adapter} stale"
                if num_pages is not None:
                    assert len(slot.pages) == num_pages(slot.adapter), \
                        f"{what}: {slot.adapter} in {len(slot.pages)} pages, it needs " \
                        f"{num_pages(slot.adapter)}"
            pages.update(slot.pages)
        assert all(n == 1 for n in pages.values()), f"{where}: a page in two slots"
        assert len(pages) == num_page_blocks, \
            f"{where}: {num_page_blocks} blocks are pages, slots hold {len(pages)}"

    def _victim(self, adapter: AdapterRef, wanted: Collection[AdapterRef | None],
                popularity: Callable[[AdapterRef], float] | None = None) -> Slot | None:
        for s in self.slots:  # an empty slot first: a load into it gives up no adapter
            if s.state is SlotState.EMPTY and not s.reserved_for:
                return s
        for s in self.slots:  # then the slot drained for it (reserved once it was staged)
            if s.reserved_for == adapter and s.pins == 0 and s.state is not SlotState.LOADING:
                return s
        evictable = [s for s in self.slots if s.state is SlotState.READY and s.pins == 0
                     and not s.is_admin_pinned and not s.reserved_for and s.adapter not in wanted]
        if popularity is None:
            return min(evictable, key=lambda s: s.last_used, default=None)
        return min(evictable, key=lambda s: (popularity(s.adapter), s.last_used), default=None)

    def _notify(self, adapter: AdapterRef, is_ready: bool) -> None:
        for callback in self._waiters.pop(adapter, []):
            callback(is_ready)
