"""What the Stats RPC reports, as plain records: a snapshot of the core's executors and their slots
(each part from the manager that keeps it: core.py's `stats`), and per tenant its queued and
running requests, its virtual counter and the totals of its ended requests (TenantTotals, which
the core keeps)."""

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace

from common.adapter_ref import AdapterRef
from scheduler.executor_state import QuantizedBase
from scheduler.fairness import FairShare
from scheduler.request import Request
from scheduler.residency.slots import SlotStats


@dataclass
class TenantTotals:
    """What one tenant's ended (finished, failed or cancelled) requests asked for and got."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    adapter_loads_caused: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, found in the prefix cache

    def add(self, req: Request) -> None:
        self.requests += 1
        self.prompt_tokens += len(req.ask.prompt_ids)
        self.completion_tokens += req.output.num_tokens
        self.adapter_loads_caused += req.charges.caused_load
        self.cached_prompt_tokens += req.charges.cached_prompt_tokens


@dataclass(frozen=True)
class ExecutorStats:
    address: str
    running: int
    queued: int
    free_kv_blocks: int
    num_kv_blocks: int
    cached_kv_blocks: int
    dedicated_to: AdapterRef | None
    is_merged: bool
    num_steps: int
    num_loads: int
    num_hits: int
    is_up: bool
    is_draining: bool
    is_drained: bool
    slots: tuple[SlotStats, ...]
    adapter_pages: int = 0
    page_bytes: int = 0
    num_evictions: int = 0
    num_early_evictions: int = 0  # (residency/hooks.py: AdapterCounters)
    kv_blocks_behind_windows: int = 0  # (steps/block_manager.py: num_behind_windows)
    quantized: QuantizedBase | None = None  # its base's quantization, what it frees
    graph_buckets: tuple[int, ...] = ()  # decode steps replayed from CUDA graphs (() : eager)
    graphs_off: str = ""  # why not, on a CUDA executor
    num_preemptions: int = 0  # running sequences preempted for KV (per address, ever)


@dataclass(frozen=True)
class TenantStats:
    tenant: str
    queued: int  # in executors' queues
    running: int
    virtual_counter: float
    totals: TenantTotals  # a copy


@dataclass(frozen=True)
class PoolStats:
    executors: tuple[ExecutorStats, ...]
    tenants: tuple[TenantStats, ...]  # by name: every tenant charged or counted so far


def tenant_stats(fair: FairShare, totals: Mapping[str, TenantTotals], running: Counter[str],
                 queued: Mapping[str, int]) -> tuple[TenantStats, ...]:
    """Every tenant charged, counted or waiting so far, by name: `running` and `queued` requests
    per tenant (in executors' queues, and those waiting for an executor to take work)."""
    tenants = sorted(set(fair.counters) | set(totals) | {t for t, n in queued.items() if n})
    return tuple(TenantStats(t, queued.get(t, 0), running[t], fair.counter(t),
                             replace(totals.get(t, TenantTotals()))) for t in tenants)
