"""When a waiting request gives up: its client's deadline, the pool's longest queue wait, or
the longest wait for its adapter's fetch.

A request is entered when it arrives: at its client's deadline (gRPC's, taken at arrival) it is
dropped with DEADLINE_EXCEEDED wherever it waits; one never admitted within `max_queue_s` is
refused with RESOURCE_EXHAUSTED and a retry-after (UNAVAILABLE when the reason is an adapter that
keeps failing to load). A request that ran and waits again (preempted, or its executor was lost)
is entered again: not taken back within `max_queue_s` of that (no executor left, say), it ends
UNAVAILABLE, retryable. A request for an adapter is also looked at `max_load_wait_s` into each
wait (LOAD_BOUND): the scheduler fails it (UNAVAILABLE, retryable) if its adapter's fetch has
been under way that long, or has it looked at again (`recheck`) when that time would come.

    deadlines.add(req)                 at submit
    deadlines.requeued(req)            when it waits again (req.queued_since set)
    for req, kind in deadlines.due(now): ...   periodically (the engine's clock tick)
    deadlines.has_waited_for_its_fetch(req, now, since)   at a LOAD_BOUND: False, and looked at
                                       again later, while its fetch has not been under way that
                                       long
"""

import enum
import heapq
import itertools
import weakref
from collections.abc import Callable

from common.errors import (
    DeadlineExceeded,
    LoraplexError,
    ResourceExhausted,
    Unavailable,
    retry_after,
)
from scheduler.limits import Limits
from scheduler.request import Request, Status


class Due(enum.Enum):
    DEADLINE = "deadline"  # the client's own
    QUEUE_BOUND = "queue bound"  # the pool's max_queue_s, for a request never admitted
    LOAD_BOUND = "load bound"  # the pool's max_load_wait_s, for its adapter's fetch


class Deadlines:
    def __init__(self, max_queue_s: float, max_load_wait_s: float):
        self._max_queue_s, self._max_load_wait_s = max_queue_s, max_load_wait_s
        # (when, order, kind, request, its queued_since when entered). Weak: an entry must not
        # keep an ended request alive until its time would have come.
        self._heap: list[tuple[float, int, Due, weakref.ref[Request], float]] = []
        self._order = itertools.count()

    def add(self, req: Request) -> None:
        """Enter a request that has just arrived (req.arrival set, its ask's deadline if any)."""
        if req.ask.deadline is not None:
            self._push(req.ask.deadline, Due.DEADLINE, req)
        self.requeued(req)

    def requeued(self, req: Request) -> None:
        """It waits (again) since req.queued_since."""
        self._push(req.queued_since + self._max_queue_s, Due.QUEUE_BOUND, req)
        if req.ask.adapter is not None:
            self.recheck(req, req.queued_since + self._max_load_wait_s)

    def recheck(self, req: Request, at: float) -> None:
        """Its LOAD_BOUND comes again at `at` (in this wait)."""
        self._push(at, Due.LOAD_BOUND, req)

    def has_waited_for_its_fetch(self, req: Request, now: float, since: float | None) -> bool:
        """At req's LOAD_BOUND: whether it has waited max_load_wait_s for its adapter's fetch
        onto its executor, under way `since` then (None: nothing on its way for it now, it waits
        for a slot, say); if not, it is looked at again when it would have."""
        bound = self._max_load_wait_s
        if since is None:
            self.recheck(req, now + bound)
            return False
        start = max(since, req.queued_since)
        if now - start < bound:
            self.recheck(req, start + bound)
            return False
        return True

    def due(self, now: float) -> list[tuple[Request, Due]]:
        """Requests still waiting whose time is up."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, _, kind, ref, since = heapq.heappop(self._heap)
            req = ref()
            if req is None or req.status is not Status.QUEUED:
                continue  # running or ended: nothing to do (a running one streams on)
            if kind is not Due.DEADLINE and req.queued_since != since:
                continue  # it ran since this wait began; a later entry bounds its wait now
            out.append((req, kind))
        return out

    def _push(self, at: float, kind: Due, req: Request) -> None:
        heapq.heappush(self._heap, (at, next(self._order), kind, weakref.ref(req),
                                    req.queued_since))


def expiry_error(req: Request, due: Due, now: float, limits: Limits,
                 expected_wait: Callable[[], float],
                 load_error: LoraplexError | None) -> LoraplexError:
    """What a request whose time came (`due`) at `now` ends with, and why, in words a client can
    act on; `expected_wait()` is the pool's estimate of a new request's wait, in seconds, and
    `load_error` the last error of its adapter's failing fetches on its executor, if any."""
    waited = now - req.arrival
    adapter = req.ask.adapter
    if due is Due.LOAD_BOUND:
        why = (f"its fetches fail (last error: {load_error})" if load_error is not None
               else "its fetch is still under way")
        return retry_after(Unavailable(
            f"adapter {adapter} was not loaded within {limits.max_load_wait_s:.0f}s "
            f"({why}); retry later"), limits.max_load_backoff_s)
    if due is Due.DEADLINE:
        return DeadlineExceeded(f"the request's deadline passed after {waited:.1f}s "
                                "waiting for an executor")
    if req.admitted_at is not None:
        return Unavailable(f"waited {now - req.queued_since:.0f}s to be resumed after its "
                           "executor was lost or its KV preempted, past the pool's "
                           "max_queue_s; retry")
    if load_error is not None:
        return retry_after(Unavailable(
            f"adapter {adapter} could not be loaded within {waited:.0f}s "
            f"(last error: {load_error}); retry later"), limits.max_load_backoff_s)
    wait = expected_wait()
    return retry_after(ResourceExhausted(
        f"not admitted within {waited:.0f}s (the pool's max_queue_s): the pool is "
        f"overloaded or has no executor up; retry in {wait:.0f}s"), wait)
