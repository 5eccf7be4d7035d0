"""Adapter residency on one executor: which adapter each GPU slot holds, and who pins it.

A slot is EMPTY, LOADING or READY. Running sequences pin the slot of their adapter for their whole
life; a pinned slot is never evicted. Among unpinned READY slots the least recently used is the
one given up when a new adapter needs room.
"""

import enum
import itertools
from collections.abc import Collection
from dataclasses import dataclass


class SlotState(enum.Enum):
    EMPTY = "empty"
    LOADING = "loading"
    READY = "ready"


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.EMPTY
    adapter: str = ""  # "name@version" while LOADING or READY
    pins: int = 0
    last_used: int = 0  # logical clock, for LRU


class SlotTable:
    def __init__(self, num_slots: int):
        self.slots = [Slot(i) for i in range(num_slots)]
        self._clock = itertools.count(1)

    def find(self, adapter: str) -> Slot | None:
        """The slot holding or loading `adapter`, if any."""
        for slot in self.slots:
            if slot.adapter == adapter and slot.state is not SlotState.EMPTY:
                return slot
        return None

    def is_ready(self, adapter: str) -> bool:
        slot = self.find(adapter)
        return slot is not None and slot.state is SlotState.READY

    def can_place(self) -> bool:
        return self._victim(frozenset()) is not None

    def place(self, adapter: str, wanted: Collection[str] = frozenset()) -> Slot:
        """Claim a slot for loading `adapter`: an empty one, else the least recently used unpinned
        one, sparing adapters in `wanted` (queued requests need them) while another choice exists."""
        slot = self._victim(wanted)
        if slot is None:
            raise RuntimeError(f"no slot can take {adapter}: every slot is pinned or loading")
        slot.state, slot.adapter, slot.pins = SlotState.LOADING, adapter, 0
        return slot

    def mark_ready(self, slot: Slot) -> None:
        slot.state = SlotState.READY
        slot.last_used = next(self._clock)

    def clear(self, slot: Slot) -> None:
        if slot.pins:
            raise RuntimeError(f"slot {slot.index} ({slot.adapter}) is pinned {slot.pins} times")
        slot.state, slot.adapter = SlotState.EMPTY, ""

    def pin(self, slot: Slot) -> None:
        if slot.state is not SlotState.READY:
            raise RuntimeError(f"slot {slot.index} is {slot.state.value}, cannot pin")
        slot.pins += 1
        slot.last_used = next(self._clock)

    def unpin(self, slot: Slot) -> None:
        if slot.pins <= 0:
            raise RuntimeError(f"slot {slot.index} unpinned more often than pinned")
        slot.pins -= 1
        slot.last_used = next(self._clock)

    def _victim(self, wanted: Collection[str]) -> Slot | None:
        empty = [s for s in self.slots if s.state is SlotState.EMPTY]
        if empty:
            return empty[0]
        evictable = [s for s in self.slots if s.state is SlotState.READY and s.pins == 0]
        return min(evictable, key=lambda s: (s.adapter in wanted, s.last_used), default=None)
