"""When a waiting request gives up: its client's deadline, or the pool's longest queue wait.

Every request is entered once, when it arrives: at its client's deadline (gRPC's, taken at
arrival) it is dropped with DEADLINE_EXCEEDED wherever it waits; a request never admitted within
`max_queue_s` is refused with RESOURCE_EXHAUSTED and a retry-after (UNAVAILABLE when the reason is
an adapter that keeps failing to load). A request that already streamed tokens and waits again
(preempted, or its executor was lost) is bounded by its client's deadline only: failing it for
the pool's queue bound would lose what the client already has.

    deadlines.add(req, now)            at submit
    for req, kind in deadlines.due(now): ...   periodically (the engine's clock tick)
"""

import enum
import heapq
import itertools
import weakref

from scheduler.request import Request, Status


class Due(enum.Enum):
    DEADLINE = "deadline"  # the client's own
    QUEUE_BOUND = "queue bound"  # the pool's max_queue_s, for a request never admitted


class Deadlines:
    def __init__(self, max_queue_s: float):
        self._max_queue_s = max_queue_s
        # Weak: an entry must not keep an ended request alive until its time would have come.
        self._heap: list[tuple[float, int, Due, weakref.ref[Request]]] = []
        self._order = itertools.count()

    def add(self, req: Request) -> None:
        """Enter a request that has just arrived (req.arrival set, req.deadline if any)."""
        if req.deadline is not None:
            self._push(req.deadline, Due.DEADLINE, req)
        self._push(req.arrival + self._max_queue_s, Due.QUEUE_BOUND, req)

    def due(self, now: float) -> list[tuple[Request, Due]]:
        """Requests still waiting whose time is up."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, _, kind, ref = heapq.heappop(self._heap)
            req = ref()
            if req is None or req.status is not Status.QUEUED:
                continue  # running or ended: nothing to do (a running one streams on)
            if kind is Due.QUEUE_BOUND and req.admitted_at is not None:
                continue
            out.append((req, kind))
        return out

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def _push(self, at: float, kind: Due, req: Request) -> None:
        heapq.heappush(self._heap, (at, next(self._order), kind, weakref.ref(req)))
