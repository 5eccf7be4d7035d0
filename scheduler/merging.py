"""Dedicated executors: one hot adapter merged into an executor's base weights.

"Merge for a dedicated heavy customer, share for the long tail": merged, an adapter's rows run
the base model's matmuls alone (no LoRA work), but that executor serves nothing else.

Life of a merge on executor ex (ExecutorState.dedicated_to, merged_slot, unmerge_due):
  dedicate(core, ex, adapter)  ex admits only `adapter` from now on: its queued requests for
                               anything else move to other executors, its running ones finish;
                               the adapter is brought in if it is not resident.
  core.schedule                once ex runs nothing else and the adapter is READY there, the
                               step carries merge_slot: the executor folds it into its weights
                               before the step's rows. The slot stays pinned while merged.
  release(core, ex)            ex serves everyone again: the next step carries unmerge (the
                               executor restores its weights before anything else in it), and
                               the slot is unpinned once that step is answered (a load into it
                               before would be refused).
No request fails or waits unboundedly for a merge: queued work moves, running work finishes.
Routing (placement.py) never sends another adapter's request to a dedicated executor, and
prefers dedicated executors for their own adapter. At least one executor that is up serves
everyone: a dedication that would leave none is refused, and when the last one is lost the
dedicated executors are released.

MergePolicy merges automatically (Limits.merge_share > 0): an adapter with at least merge_share
of the pool's computed tokens over the last merge_window_s is merged into one more executor
(with at least two up, never the last serving everyone); a merged adapter whose share stays
below unmerge_share over a window is unmerged. After any change, a full window passes before the
next (hysteresis in time as well as in share).
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

from common.adapter_ref import AdapterRef
from common.errors import FailedPrecondition, Unavailable
from scheduler.executor_state import ExecutorState, Limits, StepPlan
from scheduler.routing import score
from scheduler.slots import Slot, SlotState

if TYPE_CHECKING:
    from scheduler.core import Scheduler

log = logging.getLogger(__name__)


def serving_everyone(core: Scheduler) -> list[ExecutorState]:
    return [ex for ex in core.executors if ex.is_admitting and ex.dedicated_to is None]


def dedicate(core: Scheduler, ex: ExecutorState, adapter: AdapterRef, adapter_bytes: int) -> None:
    """Give ex to `adapter` alone; it merges once it runs nothing else (see core.schedule)."""
    if ex.dedicated_to == adapter:
        return
    if ex.dedicated_to is not None:
        raise FailedPrecondition(f"executor {ex.address} is dedicated to {ex.dedicated_to}; "
                                 "unmerge it first")
    if not ex.is_admitting:
        raise Unavailable(f"executor {ex.address} is down or draining: it cannot take a merge")
    if [e for e in serving_everyone(core) if e is not ex] == []:
        raise FailedPrecondition(f"merging {adapter} into {ex.address} would leave no executor "
                                 "serving every adapter: the pool needs another one up")
    ex.dedicated_to, ex.dedicated_bytes = adapter, adapter_bytes
    for req in [r for r in ex.queue if r.adapter != adapter]:
        core.move(req)
    if ex.slots.find(adapter) is None:
        core.bring_in(ex, adapter, adapter_bytes)
    core.place_work()  # its adapter's queued requests elsewhere may start sooner here
    log.info("executor %s dedicated to %s: it merges once it runs nothing else", ex.address,
             adapter)
    core.wake()


def release(core: Scheduler, ex: ExecutorState) -> None:
    """ex serves every adapter again (its weights are restored by its next step)."""
    if ex.dedicated_to is None:
        return
    log.info("executor %s released from %s", ex.address, ex.dedicated_to)
    ex.dedicated_to = None
    if ex.merged_slot is not None:
        ex.unmerge_due = True
    core.place_work()  # (requests with nowhere to go while it was dedicated, too)
    core.wake()


def merge_now(core: Scheduler, ex: ExecutorState) -> int | None:
    """The slot to merge in the step being planned: ex is dedicated, not merged, its adapter
    READY here, and every sequence it runs is of that adapter. Until its adapter is here, each
    plan tries to bring it in (its slot may have been pinned by the other adapters' sequences,
    and no request of its own may be waiting to ask)."""
    adapter = ex.dedicated_to
    if adapter is None or ex.merged_slot is not None or ex.unmerge_due or ex.unmerging:
        return None  # (an unmerge on its way: merge again once it is answered)
    slot = ex.slots.find(adapter)
    if slot is None:
        core.bring_in(ex, adapter, ex.dedicated_bytes)
        return None
    if slot.state is not SlotState.READY:
        return None
    if any(seq.request.adapter != adapter for seq in ex.running.values()):
        return None
    ex.slots.pin(slot)  # never evicted while merged
    ex.merged_slot = slot
    log.info("merging %s into executor %s (slot %d)", adapter, ex.address, slot.index)
    return slot.index


def unmerge_now(ex: ExecutorState) -> bool:
    """Whether the step being planned unmerges: from it on, ex's weights are the base model's;
    the slot stays pinned until the step is answered."""
    if not ex.unmerge_due:
        return False
    ex.unmerge_due = False
    ex.unmerging, ex.merged_slot = ex.merged_slot, None
    return True


def on_step_done(ex: ExecutorState, plan: StepPlan) -> None:
    """An answered unmerge: the slot may be given away."""
    if plan.unmerge and ex.unmerging is not None:
        slot: Slot = ex.unmerging
        ex.unmerging = None
        ex.slots.unpin(slot)


def forget(ex: ExecutorState) -> None:
    """Ex was lost: its weights are restored when its stream ends; it serves everyone when
    back."""
    ex.dedicated_to, ex.merged_slot, ex.unmerging, ex.unmerge_due = None, None, None, False


def keep_one_serving_everyone(core: Scheduler) -> None:
    """No executor up serves everyone any more: release the dedicated ones."""
    if not serving_everyone(core):
        for ex in core.executors:
            if ex.dedicated_to is not None and ex.is_up:
                log.warning("no executor serving every adapter is up: releasing %s from %s",
                            ex.address, ex.dedicated_to)
                release(core, ex)


def merge(core: Scheduler, adapter: AdapterRef, adapter_bytes: int,
          num_executors: int) -> list[ExecutorState]:
    """Dedicate `num_executors` executors to `adapter` (those dedicated already count), choosing
    where it is resident and the least loaded first; at least one up executor keeps serving
    everyone."""
    up = [ex for ex in core.executors if ex.is_admitting]
    have = [ex for ex in up if ex.dedicated_to == adapter]
    free = [ex for ex in up if ex.dedicated_to is None]
    want = num_executors - len(have)
    if want > 0 and want > len(free) - 1:
        raise FailedPrecondition(
            f"cannot merge {adapter} into {num_executors} executors: {len(have)} are merged "
            f"with it, {len(free)} up serve everyone, and one of those must keep doing so")
    free.sort(key=lambda ex: (ex.slots.find(adapter) is None,
                              score(ex.work_tokens, ex.rates, True, True, adapter_bytes, 0.0)))
    for ex in free[:max(want, 0)]:
        dedicate(core, ex, adapter, adapter_bytes)
    return [ex for ex in up if ex.dedicated_to == adapter]


def unmerge(core: Scheduler, adapter: AdapterRef | None, address: str = "") -> list[str]:
    """Release the executors dedicated to `adapter` (any adapter: None), or only `address`."""
    released = []
    for ex in core.executors:
        if ex.dedicated_to is not None and (adapter is None or ex.dedicated_to == adapter) \
                and (not address or ex.address == address):
            release(core, ex)
            released.append(ex.address)
    return released


class MergePolicy:
    """Merges by traffic: token shares per adapter over the last window (see the module doc)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self._tokens: collections.deque[tuple[float, AdapterRef | None, int]] = collections.deque()
        self._total = 0
        self._by_adapter: collections.Counter[AdapterRef | None] = collections.Counter()
        self._quiet_until = 0.0  # no change before (a full window after the last)
        self._bytes: dict[AdapterRef, int] = {}

    def observe(self, plan: StepPlan, now: float) -> None:
        """Count a step's computed tokens per adapter."""
        if not self.limits.merge_share:
            return
        if not self._quiet_until:  # a full window of traffic before the first decision
            self._quiet_until = now + self.limits.merge_window_s
        per: collections.Counter[AdapterRef | None] = collections.Counter()
        for row in plan.rows:
            req = row.seq.request
            per[req.adapter] += row.num_tokens
            if req.adapter:
                self._bytes[req.adapter] = req.adapter_bytes
        for adapter, n in per.items():
            self._tokens.append((now, adapter, n))
            self._by_adapter[adapter] += n
            self._total += n

    def tick(self, core: Scheduler, now: float) -> None:
        if not self.limits.merge_share:
            return
        window = self.limits.merge_window_s
        while self._tokens and self._tokens[0][0] < now - window:
            _, adapter, n = self._tokens.popleft()
            self._by_adapter[adapter] -= n
            self._total -= n
        if now < self._quiet_until or not self._total:
            return
        share = {a: n / self._total for a, n in self._by_adapter.items() if a and n}
        merged = collections.Counter(ex.dedicated_to for ex in core.executors if ex.dedicated_to)
        for adapter in merged:
            if share.get(adapter, 0.0) < self.limits.unmerge_share:
                unmerge(core, adapter)
                return self._changed(now)
        up = [ex for ex in core.executors if ex.is_admitting]
        for adapter, s in sorted(share.items(), key=lambda item: -item[1]):
            if s < self.limits.merge_share:
                break
            # Executors in proportion to its share, rounded down by half an executor (its
            # traffic may overflow onto the others, theirs never onto its), one more per window,
            # at least one left to serve everyone.
            target = max(1, min(int(s * len(up) - 0.5), len(up) - 1))
            if merged[adapter] < target and len(serving_everyone(core)) >= 2:
                merge(core, adapter, self._bytes.get(adapter, 0), merged[adapter] + 1)
                return self._changed(now)

    def _changed(self, now: float) -> None:
        self._quiet_until = now + self.limits.merge_window_s
