"""Residency: which adapter sits in which slot of each executor, how adapters get there, and who
pins them. Residency keeps one ExecutorResidency (executor_residency.py) per executor, which holds
that executor's part privately; the other managers ask it (`residency.of(ex)`). Residency itself
keeps each executor's counters for the scheduler's life (an executor that reconnects gets a
fresh part that carries them on, so what Stats and /metrics count never goes back) and does
what spans executors: an operator's pre-warm and eviction. An operator's pin stands until that
adapter is evicted there: an executor that restarts (an empty part) has its pinned adapters
brought in and pinned again when it reconnects (`restore_pins`).

An adapter is brought closer as soon as a request for it is queued (prefetch): into an empty
slot at once; into another adapter's slot only once its bytes are staged on the executor's host
(stage before evict, slots.py), else the store is asked to warm it into its RAM tier. The tenant
whose request first causes a fetch pays for it (Admission.charge_load, fairness.py). A fetch
that fails retryably (a store or S3 down or frozen) backs off (fetches.py); any other failure is
returned to the scheduler, which fails the requests waiting for that adapter. A running sequence
pins its adapter's slot until no step in flight has a row of it. How adapters' pages share the
KV blocks: adapter_memory.py.
"""

import logging
from collections.abc import Callable, Mapping

from common.adapter_ref import AdapterRef
from common.errors import FailedPrecondition
from scheduler.executor_state import ExecutorShape, ExecutorState
from scheduler.residency.executor_residency import ExecutorResidency
from scheduler.residency.hooks import AdapterCounters, Hooks
from scheduler.routing import score

log = logging.getLogger(__name__)


class Residency:
    def __init__(self, hooks: Hooks):
        self._hooks = hooks
        self._of: dict[ExecutorState, ExecutorResidency] = {}
        self._counters: dict[str, AdapterCounters] = {}  # by address, for the process's life
        # An operator's pins, by executor address: adapter -> (its bytes, its ranks)
        self._pins: dict[str, dict[AdapterRef, tuple[int, Mapping[str, int] | None]]] = {}

    def add(self, ex: ExecutorState, shape: ExecutorShape) -> None:
        """A view of an executor that (re)connected: its slots all empty."""
        counters = self._counters.setdefault(ex.address, AdapterCounters())
        self._of[ex] = ExecutorResidency(ex, shape.num_slots, shape.geometry, shape.page_bytes,
                                         counters, self._hooks)

    def remove(self, ex: ExecutorState) -> None:
        """Forget a view of an executor (it reconnected as another, or left the pool)."""
        self._of.pop(ex, None)

    def of(self, ex: ExecutorState) -> ExecutorResidency:
        return self._of[ex]

    def get(self, ex: ExecutorState) -> ExecutorResidency | None:
        """Its part, unless the view is forgotten (a load's answer may come that late)."""
        return self._of.get(ex)

    # ---- operators --------------------------------------------------------------------------
    def prewarm(self, up: list[ExecutorState], adapter: AdapterRef, adapter_bytes: int,
                num_executors: int, pin: bool, ranks: Mapping[str, int] | None,
                work_tokens: Callable[[ExecutorState], float]) -> list[ExecutorState]:
        """Make `adapter` (with these per-module ranks) resident on `num_executors` of `up`
        (those already holding it count), choosing the least loaded others (`work_tokens`);
        with `pin`, LRU never takes those slots back."""
        holding = [ex for ex in up if self._of[ex].holds(adapter)]
        others = sorted((ex for ex in up if ex not in holding),
                        key=lambda ex: score(work_tokens(ex), ex.rates, False, True,
                                             adapter_bytes, 0.0))
        chosen = holding + others[:max(0, num_executors - len(holding))]
        for ex in chosen:
            part = self._of[ex]
            pages = part.pages_for(adapter, ranks)
            if not part.holds(adapter) and not part.can_place(adapter, pages):
                raise FailedPrecondition(f"executor {ex.address}: every adapter slot is pinned "
                                         f"or no pages can be freed for it; evict or unpin one "
                                         f"before pre-warming {adapter}")
            if pin:
                self._check_pin(ex, adapter)
        for ex in chosen:
            part = self._of[ex]
            if not part.holds(adapter):  # (staged first when it must evict another: then no
                part.bring_in(adapter, adapter_bytes, ranks)  # slot is claimed yet)
            if pin:
                part.pin_by_operator(adapter)
                self._pins.setdefault(ex.address, {})[adapter] = (adapter_bytes, ranks)
        return chosen

    def restore_pins(self, ex: ExecutorState) -> None:
        """ex (re)connected with its slots empty: bring in and pin again what an operator pinned
        there and did not evict; one that no longer fits (the executor came back smaller) is
        logged and forgotten."""
        pins = self._pins.get(ex.address, {})
        for adapter, (num_bytes, ranks) in list(pins.items()):
            part = self._of[ex]
            try:
                if not part.can_place(adapter, part.pages_for(adapter, ranks)):
                    raise FailedPrecondition("no slot or pages are free for it")
                self._check_pin(ex, adapter)
            except FailedPrecondition as err:
                log.warning("executor %s came back without room for %s, pinned there by an "
                            "operator: not pinned again (%s)", ex.address, adapter, err)
                del pins[adapter]
                continue
            part.bring_in(adapter, num_bytes, ranks)
            part.pin_by_operator(adapter)
            log.info("executor %s came back: bringing in %s, pinned there by an operator",
                     ex.address, adapter)

    def _check_pin(self, ex: ExecutorState, adapter: AdapterRef) -> None:
        """FAILED_PRECONDITION when pinning `adapter` on ex would leave fewer than
        unpinned_slots of its slots to the other adapters."""
        part, unpinned = self._of[ex], self._hooks.limits.unpinned_slots
        pinned = part.admin_pinned()
        if adapter not in pinned and len(pinned) >= part.num_slots - unpinned:
            raise FailedPrecondition(
                f"executor {ex.address}: {len(pinned)} of its {part.num_slots} adapter slots "
                f"are pinned, the most it allows (--unpinned-slots {unpinned} stay for every "
                f"other adapter); evict a pinned adapter before pinning {adapter}, or pre-warm "
                "it without pin")

    def evict(self, targets: list[ExecutorState], adapter: AdapterRef) -> int:
        """Free the slots holding `adapter` on `targets`; refused while it runs or loads."""
        holding = [self._of[ex] for ex in targets if self._of[ex].holds(adapter)]
        for part in holding:
            part.check_evict(adapter)
        for part in holding:
            part.evict(adapter)
        for ex in targets:  # (an operator's pin ends with the eviction, held now or not)
            self._pins.get(ex.address, {}).pop(adapter, None)
        return len(holding)
