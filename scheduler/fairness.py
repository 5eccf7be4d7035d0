"""Virtual-time fairness across tenants: the Virtual Token Counter (VTC, OSDI'24), extended so a
tenant also pays for the adapter loads its requests cause.

Each tenant u has a counter c[u] of weighted service received:
    admission of a request:    c[u] += input_weight * prompt_tokens / w[u]
                               (only the prompt tokens it computes: those whose KV its first
                               admission found in the prefix cache cost no compute, and are free)
    each generated token:      c[u] += output_weight / w[u]
    an adapter load it caused: c[u] += load_tokens / w[u]
where load_tokens = load_weight * (adapter bytes / load bandwidth) * executor token rate: the tokens
the executor could have produced in the time the load takes (both rates measured, see routing.py).
Admission always serves the backlogged tenant with the smallest counter. When a tenant becomes
backlogged its counter is lifted to the smallest counter among the backlogged tenants (or to the
largest counter when nobody else waits), so idle time is never banked as credit.

Guarantee. Pure VTC (Theorem 4.4, loads folded into the admission charge) bounds the service gap
of two tenants f, g backlogged over an interval by
    |W_f / w_f - W_g / w_g| <= 2 * max(input_weight * L_in + L_load, output_weight * M)
with L_in the longest prompt, L_load the largest load charge and M the most tokens one tenant can
receive in one step. `service_bound` computes it. With adapters, a tenant can be backlogged yet not
admissible (its adapter is loading, or waits for a slot to drain); a work-conserving scheduler
then serves others and the gap grows without bound. So admission also skips every tenant whose
counter exceeds the least-served backlogged tenant's by more than `fairness_window` (Limits):
    counter spread of backlogged tenants <= fairness_window + input_weight * L_in + L_load
                                             + output_weight * R
with R the tokens a tenant's already-running sequences may still produce (they are never stopped).
`spread_bound` computes it; the tests and the simulator check it. Window 0 gives plain
work-conserving VTC.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FairnessWeights:
    input_weight: float = 1.0
    output_weight: float = 2.0
    load_weight: float = 1.0
    tenant_weights: dict[str, float] = field(default_factory=dict)

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)


def service_bound(w: FairnessWeights, max_prompt: int, max_load_tokens: float,
                  max_step_tokens: int) -> float:
    """Pure VTC's bound on the service gap of two backlogged tenants (window 0, no load waits)."""
    return 2 * max(w.input_weight * max_prompt + max_load_tokens, w.output_weight * max_step_tokens)


def spread_bound(w: FairnessWeights, window: float, max_prompt: int, max_load_tokens: float,
                 max_running_output: int) -> float:
    """Our bound on the counter spread of backlogged tenants: the window, plus one admission's
    charge, plus the output its already-running sequences may still be charged."""
    return (window + w.input_weight * max_prompt + max_load_tokens
            + w.output_weight * max_running_output)


class FairShare:
    """Virtual counters of every tenant and how many requests each has waiting (anywhere)."""

    def __init__(self, weights: FairnessWeights):
        self.weights = weights
        self.counters: dict[str, float] = {}
        self.backlog: dict[str, int] = {}  # tenant -> queued requests

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def min_backlogged(self) -> float:
        return min((self.counter(t) for t in self.backlog), default=0.0)

    def on_enqueue(self, tenant: str) -> None:
        if not self.backlog.get(tenant):
            self._lift(tenant)
        self.backlog[tenant] = self.backlog.get(tenant, 0) + 1

    def on_dequeue(self, tenant: str) -> None:
        self.backlog[tenant] -= 1
        if not self.backlog[tenant]:
            del self.backlog[tenant]

    def charge(self, tenant: str, token_equivalents: float) -> None:
        weight = self.weights.weight(tenant)
        self.counters[tenant] = self.counter(tenant) + token_equivalents / weight

    def charge_input(self, tenant: str, num_tokens: int) -> None:
        self.charge(tenant, self.weights.input_weight * num_tokens)

    def charge_output(self, tenant: str, num_tokens: int = 1) -> None:
        self.charge(tenant, self.weights.output_weight * num_tokens)

    def _lift(self, tenant: str) -> None:
        others = [self.counter(t) for t in self.backlog if t != tenant]
        floor = min(others) if others else max(self.counters.values(), default=0.0)
        self.counters[tenant] = max(self.counter(tenant), floor)
