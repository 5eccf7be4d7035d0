"""Dedicated executors: one hot adapter merged into an executor's base weights. Merges holds,
privately, each executor's merge state (MergeState) and the traffic window that merges
automatically; the others ask it `dedicated_to(ex)` (routing) and `merged_adapter(ex)`.

"Merge for a dedicated heavy customer, share for the long tail": merged, an adapter's rows run
the base model's matmuls alone (no LoRA work), but that executor serves nothing else.

Life of a merge on executor ex (its MergeState):
  dedicate(ex, adapter)  ex admits only `adapter` from now on: its queued requests for anything
                         else move to other executors, its running ones finish; the adapter is
                         brought in if it is not resident.
  merge_now(ex)          asked by every plan: once ex runs nothing else and the adapter is READY
                         there, the step carries merge_slot: the executor folds it into its
                         weights before the step's rows. The slot stays pinned while merged.
  release(ex)            ex serves everyone again: the next step carries unmerge (the executor
                         restores its weights before anything else in it), and the slot is
                         unpinned once that step is answered (a load into it before would be
                         refused).
No request fails or waits unboundedly for a merge: queued work moves, running work finishes.
Routing (placement.py) never sends another adapter's request to a dedicated executor, and
prefers dedicated executors for their own adapter. At least one executor that is up serves
everyone: a dedication that would leave none is refused, and when the last one is lost the
dedicated executors are released. An executor whose base is quantized (ExecutorState.quantized)
never merges: folding B @ A into its weights would requantize them (the executor refuses it too).

MergePolicy merges automatically (Limits.merge_share > 0): an adapter with at least merge_share
of the pool's computed tokens over the last merge_window_s is merged into one more executor
(with at least two up, never the last serving everyone); a merged adapter whose share stays
below unmerge_share over a window is unmerged. After any change, a full window passes before the
next (hysteresis in time as well as in share).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from common.adapter_ref import AdapterRef
from common.errors import FailedPrecondition, Unavailable
from scheduler.executor_state import ExecutorState
from scheduler.limits import Limits
from scheduler.placement import Placement
from scheduler.residency.residency import Residency
from scheduler.routing import score
from scheduler.steps.sequence import StepPlan
from scheduler.steps.step_builder import StepBuilder

log = logging.getLogger(__name__)


@dataclass
class MergeState:
    """One executor's part in merging: dedicated to one adapter, it admits only its requests;
    once it runs nothing else a step merges it into the weights (merged_slot, pinned while
    merged). unmerge_due: the next step unmerges; its slot (unmerging) stays pinned until that
    step is answered."""

    dedicated_to: AdapterRef | None = None
    dedicated_bytes: int = 0  # its adapter's size (to bring it in)
    dedicated_ranks: Mapping[str, int] | None = None  # and its ranks (its pages)
    merged_slot: int | None = None
    unmerge_due: bool = False
    unmerging: int | None = None


class Merges:
    def __init__(self, limits: Limits, placement: Placement, residency: Residency,
                 wake: Callable[[], None]):
        self._policy = MergePolicy(limits)
        self._placement, self._residency, self._wake = placement, residency, wake
        self._state: dict[ExecutorState, MergeState] = {}

    # ---- what the others ask ----------------------------------------------------------------
    def dedicated_to(self, ex: ExecutorState) -> AdapterRef | None:
        """The adapter ex is dedicated to, if any."""
        state = self._state.get(ex)
        return None if state is None else state.dedicated_to

    def is_merged(self, ex: ExecutorState) -> bool:
        return self._state[ex].merged_slot is not None

    def merged_adapter(self, ex: ExecutorState) -> AdapterRef | None:
        """The adapter merged into ex's weights, if any."""
        slot = self._state[ex].merged_slot
        return None if slot is None else self._residency.of(ex).adapter_in(slot)

    def state(self, ex: ExecutorState) -> MergeState:
        """A copy of ex's part in merging (tests, invariants)."""
        return dataclasses.replace(self._state[ex])

    def serving_everyone(self) -> list[ExecutorState]:
        return [ex for ex in self._placement.admitting() if self._state[ex].dedicated_to is None]

    # ---- executors joining and leaving ------------------------------------------------------
    def add(self, ex: ExecutorState) -> None:
        self._state[ex] = MergeState()

    def remove(self, ex: ExecutorState) -> None:
        self._state.pop(ex, None)

    def forget(self, ex: ExecutorState) -> None:
        """Ex was lost: its weights are restored when its stream ends; it serves everyone when
        back. When no executor up serves everyone any more, the dedicated ones are released."""
        self._state[ex] = MergeState()
        self.keep_one_serving_everyone()

    def keep_one_serving_everyone(self) -> None:
        if not self.serving_everyone():
            for ex in self._placement.executors:
                dedicated = self._state[ex].dedicated_to
                if dedicated is not None and ex.is_up:
                    log.warning("no executor serving every adapter is up: releasing %s from %s",
                                ex.address, dedicated)
                    self.release(ex)

    # ---- a merge's life ---------------------------------------------------------------------
    def dedicate(self, ex: ExecutorState, adapter: AdapterRef, adapter_bytes: int,
                 ranks: Mapping[str, int] | None = None) -> None:
        """Give ex to `adapter` alone; it merges once it runs nothing else (merge_now)."""
        state = self._state[ex]
        if state.dedicated_to == adapter:
            return
        if state.dedicated_to is not None:
            raise FailedPrecondition(f"executor {ex.address} is dedicated to "
                                     f"{state.dedicated_to}; unmerge it first")
        if ex.quantized is not None:
            raise FailedPrecondition(
                f"executor {ex.address} serves a quantized base ({ex.quantized.description}): "
                f"merging {adapter} would requantize it; it serves the adapter unmerged")
        if not ex.is_admitting:
            raise Unavailable(f"executor {ex.address} is down or draining: it cannot take a "
                              "merge")
        if [e for e in self.serving_everyone() if e is not ex] == []:
            raise FailedPrecondition(f"merging {adapter} into {ex.address} would leave no "
                                     "executor serving every adapter: the pool needs another "
                                     "one up")
        state.dedicated_to, state.dedicated_bytes = adapter, adapter_bytes
        state.dedicated_ranks = ranks
        for req in [r for r in self._placement.queue(ex) if r.ask.adapter != adapter]:
            self._placement.move(req)
        part = self._residency.of(ex)
        if not part.holds(adapter):
            part.bring_in(adapter, adapter_bytes, ranks)
        self._placement.place_work()  # its adapter's queued requests elsewhere may start here
        log.info("executor %s dedicated to %s: it merges once it runs nothing else",
                 ex.address, adapter)
        self._wake()

    def release(self, ex: ExecutorState) -> None:
        """ex serves every adapter again (its weights are restored by its next step)."""
        state = self._state[ex]
        if state.dedicated_to is None:
            return
        log.info("executor %s released from %s", ex.address, state.dedicated_to)
        state.dedicated_to = None
        if state.merged_slot is not None:
            state.unmerge_due = True
        self._placement.place_work()  # (requests with nowhere to go while it was dedicated, too)
        self._wake()

    def merge_now(self, ex: ExecutorState, steps: StepBuilder) -> int | None:
        """The slot to merge in the step being planned: ex is dedicated, not merged, its adapter
        READY here, and every sequence it runs (`steps`) is of that adapter. Until its adapter
        is here, each plan tries to bring it in (its slot may have been pinned by the other
        adapters' sequences, and no request of its own may be waiting to ask)."""
        state = self._state[ex]
        adapter = state.dedicated_to
        if adapter is None or state.merged_slot is not None or state.unmerge_due \
                or state.unmerging is not None:
            return None  # (an unmerge on its way: merge again once it is answered)
        part = self._residency.of(ex)
        if not part.holds(adapter):
            part.bring_in(adapter, state.dedicated_bytes, state.dedicated_ranks)
            return None
        slot = part.ready_slot(adapter)
        if slot is None or not steps.runs_only(adapter):
            return None
        part.hold(slot)  # never evicted while merged
        state.merged_slot = slot
        log.info("merging %s into executor %s (slot %d)", adapter, ex.address, slot)
        return slot

    def unmerge_now(self, ex: ExecutorState) -> bool:
        """Whether the step being planned unmerges: from it on, ex's weights are the base
        model's; the slot stays pinned until the step is answered."""
        state = self._state[ex]
        if not state.unmerge_due:
            return False
        state.unmerge_due = False
        state.unmerging, state.merged_slot = state.merged_slot, None
        return True

    def on_step_done(self, ex: ExecutorState, plan: StepPlan) -> None:
        """An answered unmerge: the slot may be given away."""
        state = self._state[ex]
        if plan.unmerge and state.unmerging is not None:
            slot = state.unmerging
            state.unmerging = None
            self._residency.of(ex).let_go(slot)

    def on_fetch_failed(self, ex: ExecutorState, adapter: AdapterRef) -> None:
        """`adapter` can never load on ex (its fetch failed for good): it can never merge there."""
        if self._state[ex].dedicated_to == adapter:
            self.release(ex)

    # ---- operators --------------------------------------------------------------------------
    def merge(self, adapter: AdapterRef, adapter_bytes: int, num_executors: int,
              ranks: Mapping[str, int] | None = None) -> list[ExecutorState]:
        """Dedicate `num_executors` executors to `adapter` (those dedicated already count),
        choosing where it is resident and the least loaded first; at least one up executor
        keeps serving everyone. Executors of a quantized base are never chosen."""
        up = self._placement.admitting()
        have = [ex for ex in up if self._state[ex].dedicated_to == adapter]
        free = [ex for ex in up if self._state[ex].dedicated_to is None]
        want = num_executors - len(have)
        if want > 0 and want > len(free) - 1:
            raise FailedPrecondition(
                f"cannot merge {adapter} into {num_executors} executors: {len(have)} are merged "
                f"with it, {len(free)} up serve everyone, and one of those must keep doing so")
        quantized = [ex for ex in free if ex.quantized is not None]
        if want > len(free) - len(quantized):
            raise FailedPrecondition(
                f"cannot merge {adapter} into {num_executors} executors: "
                f"{', '.join(ex.address for ex in quantized)} serve a quantized base "
                f"({quantized[0].quantized.description}), which merging would requantize")
        free = [ex for ex in free if ex.quantized is None]
        free.sort(key=lambda ex: (not self._residency.of(ex).holds(adapter),
                                  score(self._placement.work_tokens(ex), ex.rates, True, True,
                                        adapter_bytes, 0.0)))
        for ex in free[:max(want, 0)]:
            self.dedicate(ex, adapter, adapter_bytes, ranks)
        return [ex for ex in up if self._state[ex].dedicated_to == adapter]

    def unmerge(self, adapter: AdapterRef | None, address: str = "") -> list[str]:
        """Release the executors dedicated to `adapter` (any adapter: None), or only
        `address`."""
        released = []
        for ex in self._placement.executors:
            dedicated = self._state[ex].dedicated_to
            if dedicated is not None and (adapter is None or dedicated == adapter) \
                    and (not address or ex.address == address):
                self.release(ex)
                released.append(ex.address)
        return released

    # ---- by traffic -------------------------------------------------------------------------
    def observe(self, plan: StepPlan, now: float) -> None:
        self._policy.observe(plan, now)

    def tick(self, now: float) -> None:
        """The clock tick: merge or unmerge by the traffic of the last window (MergePolicy)."""
        dedicated = [self._state[ex].dedicated_to for ex in self._placement.executors]
        merged = collections.Counter(adapter for adapter in dedicated if adapter)
        decision = self._policy.decide(now, merged, len(self._placement.admitting()),
                                       len(self.serving_everyone()))
        if decision is None:
            return
        adapter, num_executors = decision
        if num_executors and all(ex.quantized for ex in self.serving_everyone()):
            return  # (each executor that could take it serves a quantized base)
        if num_executors:
            self.merge(adapter, self._policy.adapter_bytes(adapter), num_executors,
                       self._policy.adapter_ranks(adapter))
        else:
            self.unmerge(adapter)
        self._policy.changed(now)


class MergePolicy:
    """Merges by traffic: token shares per adapter over the last window (see the module doc)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self._tokens: collections.deque[tuple[float, AdapterRef | None, int]] = collections.deque()
        self._total = 0
        self._by_adapter: collections.Counter[AdapterRef | None] = collections.Counter()
        self._quiet_until = 0.0  # no change before (a full window after the last)
        self._bytes: dict[AdapterRef, int] = {}
        self._ranks: dict[AdapterRef, Mapping[str, int] | None] = {}

    def adapter_bytes(self, adapter: AdapterRef) -> int:
        return self._bytes.get(adapter, 0)

    def adapter_ranks(self, adapter: AdapterRef) -> Mapping[str, int] | None:
        return self._ranks.get(adapter)

    def observe(self, plan: StepPlan, now: float) -> None:
        """Count a step's computed tokens per adapter."""
        if not self.limits.merge_share:
            return
        if not self._quiet_until:  # a full window of traffic before the first decision
            self._quiet_until = now + self.limits.merge_window_s
        per: collections.Counter[AdapterRef | None] = collections.Counter()
        for row in plan.rows:
            ask = row.seq.request.ask
            if ask.lora_from:  # (an activated LoRA is never merged: it counts as no adapter)
                per[None] += row.num_tokens
                continue
            per[ask.adapter] += row.num_tokens
            if ask.adapter:
                self._bytes[ask.adapter] = ask.adapter_bytes
                self._ranks[ask.adapter] = ask.adapter_ranks
        for adapter, n in per.items():
            self._tokens.append((now, adapter, n))
            self._by_adapter[adapter] += n
            self._total += n

    def decide(self, now: float, merged: collections.Counter[AdapterRef], num_up: int,
               num_serving_everyone: int) -> tuple[AdapterRef, int] | None:
        """(adapter, executors to merge it into: 0 to unmerge it), or None: no change now.
        `merged`: executors dedicated per adapter."""
        if not self.limits.merge_share:
            return None
        window = self.limits.merge_window_s
        while self._tokens and self._tokens[0][0] < now - window:
            _, adapter, n = self._tokens.popleft()
            self._by_adapter[adapter] -= n
            self._total -= n
        if now < self._quiet_until or not self._total:
            return None
        share = {a: n / self._total for a, n in self._by_adapter.items() if a and n}
        for adapter in merged:
            if share.get(adapter, 0.0) < self.limits.unmerge_share:
                return adapter, 0
        for adapter, s in sorted(share.items(), key=lambda item: -item[1]):
            if s < self.limits.merge_share:
                break
            # Executors in proportion to its share, rounded down by half an executor (its
            # traffic may overflow onto the others, theirs never onto its), one more per window,
            # at least one left to serve everyone.
            target = max(1, min(int(s * num_up - 0.5), num_up - 1))
            if merged[adapter] < target and num_serving_everyone >= 2:
                return adapter, merged[adapter] + 1
        return None

    def changed(self, now: float) -> None:
        """A merge or unmerge was made: the next waits a full window."""
        self._quiet_until = now + self.limits.merge_window_s
