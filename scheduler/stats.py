"""What the Stats RPC reports, as plain records: a snapshot of the core's executors and their slots,
and per tenant its queued and running requests, its virtual counter and the totals of its ended
requests (TenantTotals, which the core keeps)."""

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from common.adapter_ref import AdapterRef
from scheduler.executor_state import ExecutorState
from scheduler.fairness import FairShare
from scheduler.request import Request
from scheduler.residency.slots import SlotState


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
        self.prompt_tokens += len(req.prompt_ids)
        self.completion_tokens += req.output.num_tokens
        self.adapter_loads_caused += req.caused_load
        self.cached_prompt_tokens += req.cached_prompt_tokens


@dataclass(frozen=True)
class SlotStats:
    adapter: AdapterRef | None
    state: SlotState
    pins: int
    is_admin_pinned: bool
    reserved_for: AdapterRef | None
    num_pages: int = 0


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


def snapshot(executors: Iterable[ExecutorState], fair: FairShare,
             totals: Mapping[str, TenantTotals]) -> PoolStats:
    executors = list(executors)
    running = Counter(seq.request.tenant for ex in executors for seq in ex.running.values())
    queued = {t: sum(ex.queue.queued(t) for ex in executors) for t in fair.backlog}
    tenants = sorted(set(fair.counters) | set(totals))
    return PoolStats(
        executors=tuple(_executor(ex) for ex in executors),
        tenants=tuple(TenantStats(t, queued.get(t, 0), running[t], fair.counter(t),
                                  replace(totals.get(t, TenantTotals()))) for t in tenants))


def _executor(ex: ExecutorState) -> ExecutorStats:
    return ExecutorStats(
        address=ex.address, running=len(ex.running), queued=len(ex.queue),
        free_kv_blocks=ex.blocks.num_free, num_kv_blocks=ex.blocks.num_blocks,
        cached_kv_blocks=ex.blocks.num_cached, dedicated_to=ex.dedicated_to,
        is_merged=ex.merge.merged_slot is not None,
        num_steps=ex.counters.steps_run, num_loads=ex.counters.adapter_loads,
        num_hits=ex.counters.adapter_hits, is_up=ex.is_up,
        is_draining=ex.is_draining, is_drained=ex.is_drained,
        slots=tuple(SlotStats(s.adapter, s.state, s.pins, s.is_admin_pinned, s.reserved_for,
                              len(s.pages)) for s in ex.slots.slots),
        adapter_pages=ex.blocks.num_pages, page_bytes=ex.page_bytes)
