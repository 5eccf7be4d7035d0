"""Queued requests of one executor: per tenant, per adapter, FIFO.

Grouping by adapter lets admission look at each tenant's oldest request per adapter only, so a
request whose adapter is still loading never holds back the same tenant's other requests, and the
cost of one admission is O(adapters of that tenant), not O(queue length).

    tenant "acme":  {"bot@3": [r7, r9], "": [r8]}      heads: r7 (bot@3), r8 (base model)
"""

from collections import deque
from collections.abc import Iterator

from scheduler.request import Request


class ExecutorQueue:
    def __init__(self) -> None:
        self._tenants: dict[str, dict[str, deque[Request]]] = {}
        self.demand: dict[str, int] = {}  # adapter -> queued requests for it
        self.num_queued = 0

    def __len__(self) -> int:
        return self.num_queued

    def tenants(self) -> list[str]:
        return list(self._tenants)

    def queued(self, tenant: str) -> int:
        return sum(len(q) for q in self._tenants.get(tenant, {}).values())

    def push(self, req: Request, front: bool = False) -> None:
        group = self._tenants.setdefault(req.tenant, {}).setdefault(req.adapter, deque())
        group.appendleft(req) if front else group.append(req)
        self.demand[req.adapter] = self.demand.get(req.adapter, 0) + 1
        self.num_queued += 1

    def remove(self, req: Request) -> None:
        groups = self._tenants[req.tenant]
        group = groups[req.adapter]
        if group[0] is req:
            group.popleft()
        else:
            group.remove(req)
        if not group:
            del groups[req.adapter]
            if not groups:
                del self._tenants[req.tenant]
        self.demand[req.adapter] -= 1
        if not self.demand[req.adapter]:
            del self.demand[req.adapter]
        self.num_queued -= 1

    def heads(self, tenant: str) -> list[Request]:
        """The oldest queued request of each adapter group of `tenant`, oldest first."""
        return sorted((q[0] for q in self._tenants.get(tenant, {}).values()), key=lambda r: r.arrival)

    def __iter__(self) -> Iterator[Request]:
        for groups in self._tenants.values():
            for group in groups.values():
                yield from group
