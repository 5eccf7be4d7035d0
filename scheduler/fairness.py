"""Virtual-time fairness across tenants: the Virtual Token Counter (VTC, OSDI'24), extended so a
tenant also pays for the adapter loads its admissions cause.

Each tenant u has a counter c[u] of weighted service received:
    admission of a request:  c[u] += input_weight * prompt_tokens / w[u]
    each generated token:    c[u] += output_weight / w[u]
    an adapter load it caused: c[u] += load_tokens / w[u]   (token-equivalents of the load)
Admission always serves the backlogged tenant with the smallest counter. When a tenant becomes
backlogged its counter is lifted to the smallest counter among the other backlogged tenants (or to
the largest counter when nobody else waits), so idle time is not banked as credit.

Bound (VTC Theorem, with loads folded into the per-admission charge): for two tenants backlogged
over an interval, |W_f/w_f - W_g/w_g| <= 2 * max(input_weight * L_in + load_tokens, output_weight * M)
where L_in is the largest prompt, M the largest batch's output per step. `service_bound` computes it.
"""

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class FairnessWeights:
    input_weight: float = 1.0
    output_weight: float = 2.0
    tenant_weights: dict[str, float] = field(default_factory=dict)

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)


def service_bound(w: FairnessWeights, max_prompt: int, max_load_tokens: float, max_step_tokens: int) -> float:
    """The largest gap in weighted service between two backlogged tenants the policy allows."""
    return 2 * max(w.input_weight * max_prompt + max_load_tokens, w.output_weight * max_step_tokens)


class TenantQueues(Generic[T]):
    """Per-tenant FIFO queues ordered by virtual counters."""

    def __init__(self, weights: FairnessWeights):
        self.weights = weights
        self.counters: dict[str, float] = {}
        self._queues: dict[str, deque[T]] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def queued(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def push(self, tenant: str, item: T, front: bool = False) -> None:
        queue = self._queues.setdefault(tenant, deque())
        if not queue:
            self._lift(tenant)
        queue.appendleft(item) if front else queue.append(item)

    def remove(self, tenant: str, item: T) -> bool:
        queue = self._queues.get(tenant)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        return True

    def in_fair_order(self) -> Iterator[tuple[str, T]]:
        """Queued items, tenants by ascending counter, each tenant's queue in FIFO order.

        Iterating a tenant past its head lets a request whose adapter is ready go ahead of one
        whose adapter is still loading, so a cold adapter never holds its tenant's other work back.
        """
        for tenant in sorted((t for t, q in self._queues.items() if q), key=self._key):
            yield from ((tenant, item) for item in list(self._queues[tenant]))

    def charge(self, tenant: str, token_equivalents: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + token_equivalents / self.weights.weight(tenant)

    def charge_input(self, tenant: str, num_tokens: int) -> None:
        self.charge(tenant, self.weights.input_weight * num_tokens)

    def charge_output(self, tenant: str, num_tokens: int = 1) -> None:
        self.charge(tenant, self.weights.output_weight * num_tokens)

    def _key(self, tenant: str) -> tuple[float, str]:
        return self.counters.get(tenant, 0.0), tenant

    def _lift(self, tenant: str) -> None:
        """Lift a newly backlogged tenant to the smallest backlogged counter; when nobody else
        waits, nobody is owed service, so it joins at the largest counter seen."""
        others = [self.counters.get(t, 0.0) for t, q in self._queues.items() if q and t != tenant]
        floor = min(others) if others else max(self.counters.values(), default=0.0)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
