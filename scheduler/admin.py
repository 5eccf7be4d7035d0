"""Operator actions on residency and executors, in terms of the scheduler core: find an
executor, pre-warm an adapter (and wait for its loads), evict one. Drain and resume are the core's
own (Scheduler.drain, Scheduler.resume)."""

import asyncio

from common.adapter_ref import AdapterRef
from common.errors import FailedPrecondition, NotFound, Unavailable
from scheduler.core import Scheduler
from scheduler.executor_state import ExecutorState
from scheduler.routing import score
from scheduler.slots import SlotState


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
    up = [ex for ex in core.executors if ex.is_admitting and ex.serves(adapter)]
    if not up:
        raise Unavailable(f"no executor is up and admitting work to pre-warm {adapter} on "
                          f"({len(core.executors)} known, all down or draining)")
    holding = [ex for ex in up if ex.slots.find(adapter)]
    others = sorted((ex for ex in up if ex not in holding),
                    key=lambda ex: score(ex.work_tokens, ex.rates, False, True, adapter_bytes, 0.0))
    chosen = holding + others[:max(0, num_executors - len(holding))]
    for ex in chosen:
        slots = ex.slots
        if slots.find(adapter) is None and not slots.has_empty() and \
                not slots.can_place(adapter, ex.queue.demand):
            raise FailedPrecondition(f"executor {ex.address}: every adapter slot is pinned; "
                                     f"evict or unpin one before pre-warming {adapter}")
    for ex in chosen:
        slots = ex.slots
        # (staged first when it must evict another: then no slot is claimed yet)
        slot = slots.find(adapter) or core.bring_in(ex, adapter, adapter_bytes)
        if pin and slot is not None:
            slots.pin_by_admin(slot)
        elif pin:
            slots.when_loaded(adapter, lambda is_ready, slots=slots: is_ready and
                              slots.pin_by_admin(slots.find(adapter)))
    core.wake()
    return chosen


def loads_done(executors: list[ExecutorState], adapter: AdapterRef) -> asyncio.Future[list[str]]:
    """A future of the addresses among `executors` where `adapter` did not load, resolved (by the
    core's on_load_done, or the executor's loss) once none of them is loading it any more."""
    done: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
    pending, failed = len(executors), []

    def on_loaded(ex: ExecutorState, is_ready: bool) -> None:
        nonlocal pending
        pending -= 1
        if not is_ready:
            failed.append(ex.address)
        if not pending and not done.done():  # done: the waiting caller went away
            done.set_result(failed)

    for ex in executors:
        ex.slots.when_loaded(adapter, lambda is_ready, ex=ex: on_loaded(ex, is_ready))
    if not executors:
        done.set_result([])
    return done


def evict(core: Scheduler, adapter: AdapterRef, address: str = "") -> int:
    """Free the slots holding `adapter` (on one executor or all); refused while it runs."""
    targets = [find_executor(core, address)] if address else core.executors
    slots = [(ex, ex.slots.find(adapter)) for ex in targets if ex.slots.find(adapter)]
    for ex, slot in slots:
        if slot.pins or slot.state is SlotState.LOADING:
            what = f"{slot.pins} running sequences use it" if slot.pins else "it is still loading"
            raise FailedPrecondition(f"cannot evict {adapter} from {ex.address}: {what}; "
                                     "retry later")
    for ex, slot in slots:
        core.evict_slot(ex, slot)
    return len(slots)
