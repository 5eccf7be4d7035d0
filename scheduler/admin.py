"""Operator actions on residency and executors, in terms of the scheduler core."""

from common.adapter_ref import AdapterRef
from common.errors import FailedPrecondition, NotFound, Unavailable
from scheduler.core import Scheduler
from scheduler.executor_state import ExecutorState
from scheduler.routing import score


def find_executor(core: Scheduler, address: str) -> ExecutorState:
    for ex in core.executors:
        if ex.address == address:
            return ex
    known = ", ".join(ex.address for ex in core.executors) or "none"
    raise NotFound(f"no executor {address!r} in this pool (known: {known})")


def prewarm(core: Scheduler, adapter: AdapterRef, adapter_bytes: int, num_executors: int,
            pin: bool) -> list[ExecutorState]:
    """Make `adapter` resident on `num_executors` executors (those already holding it count),
    choosing the least loaded others; with `pin`, LRU never takes those slots back."""
    up = [ex for ex in core.executors if ex.is_up and not ex.is_draining]
    if not up:
        raise Unavailable(f"no executor is up and admitting work to pre-warm {adapter} on "
                          f"({len(core.executors)} known, all down or draining)")
    holding = [ex for ex in up if ex.slots.find(adapter)]
    others = sorted((ex for ex in up if ex not in holding),
                    key=lambda ex: score(ex.work_tokens, ex.rates, False, True, adapter_bytes, 0.0))
    chosen = holding + others[:max(0, num_executors - len(holding))]
    for ex in chosen:
        if ex.slots.find(adapter) is None:
            if not ex.slots.can_place(adapter, ex.queue.demand):
                raise FailedPrecondition(f"executor {ex.address}: every adapter slot is pinned; "
                                         f"evict or unpin one before pre-warming {adapter}")
            core.start_load_on(ex, adapter)
        if pin:
            ex.slots.find(adapter).is_admin_pinned = True
    return chosen


def evict(core: Scheduler, adapter: AdapterRef, address: str = "") -> int:
    """Free the slots holding `adapter` (on one executor or all); refused while it runs."""
    targets = [find_executor(core, address)] if address else core.executors
    slots = [(ex, ex.slots.find(adapter)) for ex in targets if ex.slots.find(adapter)]
    for ex, slot in slots:
        if slot.pins or slot.state.value == "loading":
            what = f"{slot.pins} running sequences use it" if slot.pins else "it is still loading"
            raise FailedPrecondition(f"cannot evict {adapter} from {ex.address}: {what}; retry later")
    for ex, slot in slots:
        core.evict_slot(ex, slot)
    return len(slots)
