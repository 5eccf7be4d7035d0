"""What operators ask of a pool's scheduler (the admin RPCs, admin key; Stats for any caller):
pre-warm, evict, merge and unmerge adapters, find an executor by address, and the Stats snapshot.
Each command goes to the manager that owns what it changes (core.py lists them); the service
(service.py) converts the messages around these."""

import collections
from collections.abc import Mapping

from common.adapter_ref import AdapterRef
from common.errors import NotFound, Unavailable
from scheduler.core import Scheduler
from scheduler.executor_state import ExecutorState
from scheduler.stats import ExecutorStats, PoolStats, tenant_stats


class Operators:
    def __init__(self, core: Scheduler):
        self._core = core

    def find_executor(self, address: str) -> ExecutorState:
        executors = self._core.executors
        for ex in executors:
            if ex.address == address:
                return ex
        known = ", ".join(ex.address for ex in executors) or "none"
        raise NotFound(f"no executor {address!r} in this pool (known: {known})")

    def prewarm(self, adapter: AdapterRef, adapter_bytes: int, num_executors: int,
                pin: bool, ranks: Mapping[str, int] | None = None) -> list[ExecutorState]:
        """Make `adapter` resident on `num_executors` executors (residency.py: prewarm)."""
        core = self._core
        up = [ex for ex in core.placement.admitting()
              if core.merges.dedicated_to(ex) in (None, adapter)]
        if not up:
            raise Unavailable(f"no executor is up and admitting work to pre-warm {adapter} on "
                              f"({len(core.executors)} known, all down or draining)")
        chosen = core.residency.prewarm(up, adapter, adapter_bytes, num_executors, pin, ranks,
                                        core.placement.work_tokens)
        core.wake()
        return chosen

    def evict(self, adapter: AdapterRef, address: str = "") -> int:
        """Free the slots holding `adapter` (on one executor or all); refused while it runs."""
        targets = [self.find_executor(address)] if address else self._core.executors
        return self._core.residency.evict(targets, adapter)

    def merge(self, adapter: AdapterRef, adapter_bytes: int, num_executors: int,
              ranks: Mapping[str, int] | None = None) -> list[ExecutorState]:
        """Dedicate `num_executors` executors to `adapter`, merged into their weights."""
        return self._core.merges.merge(adapter, adapter_bytes, num_executors, ranks)

    def unmerge(self, adapter: AdapterRef | None, address: str = "") -> list[str]:
        """Release the executors dedicated to `adapter` (any: None), or only `address`."""
        return self._core.merges.unmerge(adapter, address)

    def stats(self) -> PoolStats:
        core = self._core
        executors = core.executors
        running = collections.Counter(seq.request.ask.tenant for ex in executors
                                      for seq in core.steps_of(ex).running.values())
        queues = [core.placement.queue(ex) for ex in executors]
        queued = collections.Counter({t: sum(q.queued(t) for q in queues)
                                      for t in core.fair.backlog})
        # (with no executor admitting, every executor drained or down, requests wait here)
        queued.update(req.ask.tenant for req in core.placement.orphans)
        return PoolStats(tuple(map(self._executor_stats, executors)),
                         tenant_stats(core.fair, core.totals, running, queued))

    def _executor_stats(self, ex: ExecutorState) -> ExecutorStats:
        core = self._core
        part, blocks = core.residency.of(ex), ex.blocks
        counters = part.counters()
        return ExecutorStats(
            address=ex.address, running=len(core.steps_of(ex).running),
            queued=core.placement.num_queued(ex), free_kv_blocks=blocks.num_free,
            num_kv_blocks=blocks.num_blocks, cached_kv_blocks=blocks.num_cached,
            dedicated_to=core.merges.dedicated_to(ex), is_merged=core.merges.is_merged(ex),
            num_steps=core.steps_run(ex.address), num_loads=counters.loads,
            num_hits=counters.hits, is_up=ex.is_up, is_draining=ex.is_draining,
            is_drained=core.is_drained(ex), slots=part.slot_stats(),
            adapter_pages=blocks.num_pages, page_bytes=part.page_bytes,
            num_evictions=counters.evictions, num_early_evictions=counters.early_evictions,
            num_preemptions=core.preemptions[ex.address],
            kv_blocks_behind_windows=blocks.num_behind_windows(), quantized=ex.quantized,
            graph_buckets=ex.graph_buckets, graphs_off=ex.graphs_off)
