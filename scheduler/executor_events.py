"""What an executor's adapter loads and its life do to the requests placed on it: loads and
stagings ending (or failing, with backoff), the executor lost, drained, leaving, stopping or
resumed, and its work moved to the others. Built on placement.py; Scheduler (core.py) adds the
step and admission on top.
"""

import logging

from common.adapter_ref import AdapterRef
from common.errors import Aborted, FailedPrecondition, LoraplexError, Unavailable
from scheduler import merging
from scheduler.block_manager import BlockManager
from scheduler.executor_state import ExecutorState, LoadFailure
from scheduler.placement import Placement
from scheduler.request import ErrorEvent
from scheduler.slots import Slot, SlotState

log = logging.getLogger(__name__)


class ExecutorEvents(Placement):
    def on_load_done(self, ex: ExecutorState, slot: Slot, adapter: AdapterRef,
                     error: LoraplexError | None,
                     num_bytes: int = 0, seconds: float = 0.0) -> None:
        if slot.adapter != adapter or slot.state is not SlotState.LOADING:
            return  # the executor was lost or reset meanwhile
        if error is None:
            ex.slots.mark_ready(slot)
            ex.num_loads += 1
            ex.rates.observe_load(num_bytes, seconds)
            ex.load_failures.pop(adapter, None)
        elif isinstance(error, Aborted):  # its staged bytes were gone: the slot is as it was
            ex.slots.give_back(slot)  # (staged again when wanted)
        else:
            ex.slots.clear(slot)
            self._on_fetch_failed(ex, adapter, error)
        self._wake()

    def on_stage_done(self, ex: ExecutorState, adapter: AdapterRef, error: LoraplexError | None,
                      num_bytes: int = 0, seconds: float = 0.0) -> None:
        """Its bytes are on ex's host (or could not be fetched): it may take a slot now."""
        staged = ex.slots.staged(adapter)
        if staged is None or staged.staged_at is not None:
            return  # the executor was lost or reset meanwhile
        if error is None:
            ex.slots.mark_staged(adapter, self.clock())
            ex.rates.observe_load(num_bytes, seconds)
            ex.load_failures.pop(adapter, None)
            if ex.slots.can_place(adapter, ex.queue.demand):
                self.start_load_on(ex, adapter, staged.num_bytes)
        else:
            ex.slots.stage_failed(adapter)
            self._on_fetch_failed(ex, adapter, error)
        self._wake()

    def _on_fetch_failed(self, ex: ExecutorState, adapter: AdapterRef,
                         error: LoraplexError) -> None:
        """A load or staging of `adapter` on ex failed: back off when it may succeed later (a
        store or S3 down or frozen), else fail the requests queued for it."""
        if isinstance(error, Unavailable):  # (a downstream DEADLINE_EXCEEDED arrives as this)
            previous = ex.load_failures.get(adapter)
            count = previous.count + 1 if previous else 1
            backoff = min(self.limits.max_load_backoff_s,
                          self.limits.load_backoff_s * 2 ** (count - 1))
            ex.load_failures[adapter] = LoadFailure(count, self.clock() + backoff, error)
            log.warning("fetching %s onto %s failed (%d in a row), trying again in %.1fs: %s",
                        adapter, ex.address, count, backoff, error)
            return
        ex.load_failures.pop(adapter, None)
        log.warning("fetching %s onto %s failed: %s", adapter, ex.address, error)
        for req in [r for r in ex.queue if r.adapter == adapter]:
            self._fail(req, error)
        if ex.dedicated_to == adapter:  # it can never merge there
            merging.release(self, ex)

    def remove_executor(self, ex: ExecutorState) -> None:
        """Forget an executor for good (it left the pool); its work moves to the others."""
        if ex.is_up:
            self.on_executor_lost(ex)
        self.executors = [e for e in self.executors if e is not ex]

    def on_executor_lost(self, ex: ExecutorState, error: LoraplexError | None = None) -> None:
        """Hand a dead executor's work to the others; its slots and blocks are gone. A running
        request under its max_executor_failures-th lost executor fails with `error`."""
        ex.is_up = False
        for seq in list(ex.running.values()):
            req = seq.request
            req.executor_failures += 1
            if req.executor_failures >= self.limits.max_executor_failures:
                self._release(ex, seq)
                self._end(req)
                req.emit(ErrorEvent(Unavailable(
                    f"{req.executor_failures} executors failed while running this request, the "
                    f"last {ex.address}: {error or 'it went away'}")))
        self._evacuate(ex, running=True)
        ex.pending_frees.clear()
        ex.unpin_later.clear()
        ex.slots.reset()
        ex.blocks = BlockManager(ex.blocks.num_blocks, ex.blocks.block_size)
        merging.forget(ex)
        merging.keep_one_serving_everyone(self)
        self._wake()

    def drain(self, ex: ExecutorState) -> None:
        """Admit nothing new on ex; its running sequences finish, its queue moves elsewhere."""
        ex.is_draining = True
        self._evacuate(ex, running=False)
        merging.keep_one_serving_everyone(self)
        self._wake()

    def leave(self, ex: ExecutorState) -> None:
        """Ex is gone from discovery: drain it (if up); it is forgotten once drained."""
        ex.is_leaving = True
        if ex.is_up:
            self.drain(ex)
        self._wake()

    def stop(self, ex: ExecutorState) -> None:
        """Ex is shutting down (its health said NOT_SERVING): drain it, release it once drained."""
        ex.is_stopping = True
        self.drain(ex)

    def resume(self, ex: ExecutorState) -> None:
        """Admit on a drained executor again: requests that had nowhere to go (every executor
        drained) go to it, queued ones that would start sooner there move. Refused for one that
        is down, leaving or stopping."""
        if not ex.can_resume:
            raise FailedPrecondition(f"executor {ex.address} is shutting down, down or leaving "
                                     "the pool; it cannot admit work")
        ex.is_draining = False
        self._place_work()

    def _evacuate(self, ex: ExecutorState, running: bool) -> None:
        if running:
            for seq in list(ex.running.values()):
                self._preempt(ex, seq)
        for req in list(ex.queue):
            self._dequeue(req)
            self._route(req)
