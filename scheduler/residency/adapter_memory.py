"""How an executor's KV blocks are shared between the KV cache and adapters' weights: the policy,
in one place. (The page layout itself is common/adapter_pages.py; BlockManager keeps the blocks,
SlotTable which adapter holds which pages; ExecutorResidency acts on what this decides.)

An executor whose Info gives a page geometry keeps adapters' weights in KV blocks, each adapter
in the pages its real ranks take. The scheduler decides which block is what:

  - A load takes settled free blocks, then cached prefix blocks (least recently used first),
    as long as `kv_reserve` of the executor's blocks, and every block the running sequences
    will still grow into and the requests queued ahead of its own will take (Placement.kv_ahead),
    stays free for KV (a load never preempts anyone, nor takes what the requests before its own
    need: they would evict adapters that are waited for); past that, it evicts
    adapters nobody runs, pins, reserves or waits for (least popular first). Evicting for a
    load happens only once its bytes are staged (stage before evict, slots.py). When nothing
    frees enough, the load waits: its requests wait, bounded (max_load_wait_s, max_queue_s).
  - KV that needs blocks (a sequence growing, an admission) takes free and cached blocks; when
    there are too few, it evicts those same unwanted adapters; a running sequence that still
    lacks blocks then evicts adapters that queued requests want but nothing runs, before any
    sequence is preempted (so a request that fits an executor with its adapter always finishes),
    and so does the request admission stops at (its adapter excepted): those adapters' requests
    are behind it in fair order, and kept, their pages could hold it, and so them, for good.
    While sequences run and such adapters sit idle (`has_wanted_idle`), admission does not take
    them: it waits until a request's whole run fits without (admission.py), for the running
    sequences will end and free their blocks, and the adapters' requests may start before.
  - An adapter that runs (a sequence pins it), that an operator pinned, or that queued requests
    want is never taken. An evicted adapter's cached prefix blocks (its KV, useless without it)
    are freed with its pages.
So adapters take the memory KV leaves idle, and give it back under KV pressure.

Blocks and loads are ordered: a block that left a sequence becomes a page only once every step
that may read it is answered (BlockManager.settle); a load that failed keeps its pages until
the executor answers an UnloadAdapter of its slot (SlotState.CLEANING), for its copy may outlive
its RPC. Without a page geometry every adapter takes 0 pages (fixed slots beside the KV cache).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from common.adapter_pages import PageGeometry, plan_pages
from common.adapter_ref import AdapterRef
from scheduler.residency.slots import Slot, SlotTable
from scheduler.steps.block_manager import BlockManager


class AdapterPages:
    """The pages each adapter takes on one executor, planned once per adapter from its ranks
    and the executor's page geometry (none: fixed slots beside the KV blocks, 0 pages each)."""

    def __init__(self, geometry: PageGeometry | None):
        self._geometry = geometry
        self._counts: dict[AdapterRef, int] = {}

    @property
    def is_paged(self) -> bool:
        return self._geometry is not None

    def of(self, adapter: AdapterRef | None, ranks: Mapping[str, int] | None) -> int:
        """Pages `adapter` (with these per-module ranks) takes."""
        if self._geometry is None or adapter is None:
            return 0
        count = self._counts.get(adapter)
        if count is None:
            if ranks is None:
                raise ValueError(f"the pages of {adapter} are not known: its ranks are missing")
            count = self._counts[adapter] = plan_pages(ranks, self._geometry).num_pages
        return count

    def planned(self, adapter: AdapterRef) -> int:
        """The pages of an adapter planned already."""
        return self._counts[adapter]

    def all_planned(self) -> dict[AdapterRef, int]:
        return dict(self._counts)


def free_for_pages(blocks: BlockManager, kv_reserve: float, growing: int) -> int:
    """Blocks a load may take without evicting anyone: settled ones, beyond the reserve (a
    `kv_reserve` share of the blocks) and beyond the `growing` blocks the running sequences will
    still grow into (a load never preempts them)."""
    reserve = max(int(kv_reserve * blocks.num_blocks), growing)
    return max(0, min(blocks.num_settled(), blocks.num_free - reserve))


def evictions_for(slots: SlotTable, num_pages: int, have: int, keep: Slot | None,
                  wanted: Collection[AdapterRef | None],
                  popularity: Callable[[AdapterRef], float]) -> list[Slot] | None:
    """The adapters to evict (least popular first, never `keep` nor a `wanted` one) for
    `num_pages` to fit beside the `have` pages a load may take now; [] when they fit already,
    None when they cannot."""
    out: list[Slot] = []
    if have >= num_pages:
        return out
    for slot in slots.evictable(wanted, popularity):
        if slot is keep or not slot.pages:
            continue
        out.append(slot)
        have += len(slot.pages)
        if have >= num_pages:
            return out
    return None


def kv_victims(slots: SlotTable, wanted: Collection[AdapterRef | None],
               popularity: Callable[[AdapterRef], float], wanted_too: bool,
               keep: AdapterRef | None = None, reserved_too: bool = False) -> list[Slot]:
    """Adapters KV may take pages back from, the first to go first: those nobody waits for
    (not `wanted`), then, with `wanted_too`, those queued requests wait for but nothing runs (a
    running sequence growing, or the request admission stops at: rather a reload later than a
    sequence recomputed, or work that could never start), then, with `reserved_too`, slots
    reserved to drain for a starving adapter (a running sequence growing: a reservation must
    not preempt running work; it did, and the sequence, admitted again at once, took the same
    blocks and was preempted again, thousands of times until the reservation lapsed). Never
    `keep`."""
    unwanted = [s for s in slots.evictable(wanted, popularity) if s.pages and s.adapter != keep]
    if not wanted_too:
        return unwanted
    victims = list(unwanted)
    for more in (slots.evictable((), popularity),
                 slots.evictable((), popularity, reserved_too=True) if reserved_too else ()):
        gone = set(map(id, victims))
        victims += [s for s in more if s.pages and id(s) not in gone and s.adapter != keep]
    return victims


def has_wanted_idle(slots: SlotTable, wanted: Collection[AdapterRef | None]) -> bool:
    """An adapter that queued requests want is READY in pages that KV could take back: nothing
    runs it, nobody pinned or reserved its slot."""
    return any(s.pages and s.adapter in wanted for s in slots.evictable((), _unranked))


def _unranked(adapter: AdapterRef) -> float:
    return 0.0
