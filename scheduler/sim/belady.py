"""Yardsticks for the online eviction policy on a recorded access trace.

- `belady_hits`: Belady's offline optimum (on a miss with a full cache, evict the item whose next
  use is farthest in the future) with plain slots: an upper bound no serving system reaches,
  because a real slot cannot be evicted while a running sequence uses it.
- `pinned_belady_hits`: the same clairvoyant choice on the same trace, but each access pins its item
  until that sequence ends (the trace says when), and a pinned item cannot be evicted: the offline
  optimum under the pins the workload itself imposes (tests/scheduler/test_simulator.py checks it
  against exhaustive search on traces that, like an executor's, never pin more items than there are
  slots). Should every cached item be pinned at a miss, it evicts the farthest pinned one anyway
  (the online policy would have to wait instead).
- `lru_hits`: plain least-recently-used, no pins.

A pinned trace is a list of events in time order: ("+", item, seq) when sequence `seq` starts on
`item` (an access), ("-", item, seq) when it ends.
"""

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
    return pinned_belady_hits([e for item in trace for e in (("+", item, 0), ("-", item, 0))],
                              capacity)


def pinned_belady_hits(events: Sequence[tuple[str, str, int]], capacity: int) -> int:
    """Hits of clairvoyant eviction on a pinned trace (see the module doc) with `capacity` slots."""
    if capacity <= 0:
        return 0
    accesses = [i for i, (kind, _, _) in enumerate(events) if kind == "+"]
    never = len(events)
    next_use: dict[int, int] = {}  # event index of an access -> index of its item's next access
    last_seen: dict[str, int] = {}
    for i in reversed(accesses):
        item = events[i][1]
        next_use[i] = last_seen.get(item, never)
        last_seen[item] = i
    cached: dict[str, int] = {}  # item -> its next use
    pins: dict[str, int] = {}
    heap: list[tuple[int, str]] = []  # (-next use, item); stale entries skipped lazily
    hits = 0
    for i, (kind, item, _) in enumerate(events):
        if kind == "-":
            pins[item] -= 1
            continue
        if item in cached:
            hits += 1
        elif len(cached) >= capacity:
            _evict(cached, pins, heap)
        cached[item] = next_use[i]
        pins[item] = pins.get(item, 0) + 1
        heapq.heappush(heap, (-next_use[i], item))
    return hits


def _evict(cached: dict[str, int], pins: dict[str, int], heap: list[tuple[int, str]]) -> None:
    """Drop the unpinned cached item used farthest in the future (the farthest pinned one if all
    are pinned)."""
    pinned: list[tuple[int, str]] = []
    while heap:
        entry = heapq.heappop(heap)
        if cached.get(entry[1]) != -entry[0]:
            continue  # stale
        if pins.get(entry[1], 0) == 0:
            del cached[entry[1]]
            break
        pinned.append(entry)
    else:
        entry = pinned.pop(0)
        del cached[entry[1]]
    for entry in pinned:
        heapq.heappush(heap, entry)
