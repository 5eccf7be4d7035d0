"""Yardsticks for the online eviction policy on a recorded access trace: Belady's offline optimum
(on a miss with a full cache, evict the item whose next use is farthest in the future: the best
any policy can do) and plain LRU. Neither knows about pins: a real slot cannot be evicted while a
running sequence uses it, so the online policy chooses among fewer slots than they do."""

import heapq
from collections import OrderedDict
from collections.abc import Sequence


def lru_hits(trace: Sequence[str], capacity: int) -> int:
    """Hits of least-recently-used eviction on `trace` with `capacity` slots."""
    cache: OrderedDict[str, None] = OrderedDict()
    hits = 0
    for item in trace:
        if item in cache:
            hits += 1
            cache.move_to_end(item)
            continue
        if len(cache) >= capacity:
            cache.popitem(last=False)
        if capacity > 0:
            cache[item] = None
    return hits


def belady_hits(trace: Sequence[str], capacity: int) -> int:
    """Hits of the optimal policy on `trace` (accesses in order) with `capacity` slots."""
    if capacity <= 0:
        return 0
    never = len(trace)
    next_use = [never] * len(trace)
    last_seen: dict[str, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = last_seen.get(trace[i], never)
        last_seen[trace[i]] = i
    cached: dict[str, int] = {}  # item -> its next use
    heap: list[tuple[int, str]] = []  # (-next use, item); stale entries skipped lazily
    hits = 0
    for i, item in enumerate(trace):
        if item in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:
                neg_next, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg_next:
                    del cached[victim]
                    break
        cached[item] = next_use[i]
        heapq.heappush(heap, (-next_use[i], item))
    return hits
