"""Queued requests of one executor: per tenant, per adapter, FIFO.

Grouping by adapter lets admission ask "what is this tenant's oldest request for an adapter that
is resident here?" by looking at the resident adapters only (a few slots), so a request whose
adapter is still loading never holds back the same tenant's other requests, and an admission costs
O(slots), not O(queue length). A per-tenant FIFO (entries checked lazily) gives the tenant's oldest
request overall, whose adapter is the one to bring in next.

    tenant "acme":  groups {bot@3: [r7, r9], None: [r8]}   fifo [r7, r8, r9]
"""

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from common.adapter_ref import AdapterRef
from scheduler.request import Request


class QueueView(Protocol):
    """What the others may ask of an executor's queue (Placement alone changes it)."""

    demand: Mapping[AdapterRef | None, int]  # adapter -> queued requests for it

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...

    def tenants(self) -> list[str]: ...

    def queued(self, tenant: str) -> int: ...

    def head(self, tenant: str, adapter: AdapterRef | None) -> Request | None: ...

    def oldest(self, tenant: str) -> Request | None: ...

    def ahead(self, is_ready: Callable[[AdapterRef | None], bool],
              before: Request | None) -> Iterator[Request]: ...


class ExecutorQueue:
    def __init__(self) -> None:
        # tenant -> adapter (None: the base model) -> FIFO
        self._groups: dict[str, dict[AdapterRef | None, deque[Request]]] = {}
        self._fifo: dict[str, deque[tuple[int, Request]]] = {}  # tenant -> (entry token, request)
        self._tokens = itertools.count(1)
        self._entry: dict[int, int] = {}  # id(request) -> token of its live fifo entry
        self.demand: dict[AdapterRef | None, int] = {}  # adapter -> queued requests for it
        self.num_queued = 0

    def __len__(self) -> int:
        return self.num_queued

    def tenants(self) -> list[str]:
        return list(self._groups)

    def queued(self, tenant: str) -> int:
        return sum(len(q) for q in self._groups.get(tenant, {}).values())

    def push(self, req: Request, front: bool = False) -> None:
        tenant, adapter = req.ask.tenant, req.ask.adapter
        group = self._groups.setdefault(tenant, {}).setdefault(adapter, deque())
        fifo = self._fifo.setdefault(tenant, deque())
        token = next(self._tokens)
        self._entry[id(req)] = token
        if front:
            group.appendleft(req)
            fifo.appendleft((token, req))
        else:
            group.append(req)
            fifo.append((token, req))
        self.demand[adapter] = self.demand.get(adapter, 0) + 1
        self.num_queued += 1

    def remove(self, req: Request) -> None:
        tenant, adapter = req.ask.tenant, req.ask.adapter
        groups = self._groups[tenant]
        group = groups[adapter]
        if group[0] is req:
            group.popleft()
        else:
            group.remove(req)
        if not group:
            del groups[adapter]
            if not groups:
                del self._groups[tenant]
                del self._fifo[tenant]
        del self._entry[id(req)]
        self.demand[adapter] -= 1
        if not self.demand[adapter]:
            del self.demand[adapter]
        self.num_queued -= 1

    def head(self, tenant: str, adapter: AdapterRef | None) -> Request | None:
        """The tenant's oldest queued request for `adapter` (None = base model)."""
        group = self._groups.get(tenant, {}).get(adapter)
        return group[0] if group else None

    def oldest(self, tenant: str) -> Request | None:
        """The tenant's oldest queued request, whatever its adapter."""
        fifo = self._fifo.get(tenant)
        while fifo:
            token, req = fifo[0]
            if self._entry.get(id(req)) == token:
                return req
            fifo.popleft()  # removed since it was queued
        return None

    def ahead(self, is_ready: Callable[[AdapterRef | None], bool],
              before: Request | None) -> Iterator[Request]:
        """Queued requests that arrived before `before` (None: all) for adapters that
        `is_ready` (None: the base model), the oldest first."""
        end = (math.inf, 0) if before is None else in_line(before)
        return heapq.merge(*(itertools.takewhile(lambda r: in_line(r) < end, group)
                             for groups in self._groups.values()
                             for adapter, group in groups.items() if is_ready(adapter)),
                           key=in_line)

    def __iter__(self) -> Iterator[Request]:
        for groups in self._groups.values():
            for group in groups.values():
                yield from group


def in_line(req: Request) -> tuple[float, int]:
    """Where req stands in line: by arrival (ties broken by the scheduler's number for it)."""
    return req.arrival, req.serial
