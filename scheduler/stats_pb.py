"""The Stats RPC's answer (scheduler.proto: StatsResponse), made from the core's snapshot
(stats.py: PoolStats)."""

from common.adapter_ref import AdapterRef
from protos import common_pb2, scheduler_pb2
from scheduler.executor_state import QuantizedBase
from scheduler.stats import ExecutorStats, PoolStats, TenantStats


def adapter_pb(adapter: AdapterRef | None) -> common_pb2.AdapterRef | None:
    return adapter.to_pb() if adapter else None


def stats_pb(stats: PoolStats) -> scheduler_pb2.StatsResponse:
    return scheduler_pb2.StatsResponse(executors=[_executor_pb(ex) for ex in stats.executors],
                                       tenants=[_tenant_pb(t) for t in stats.tenants])


def _executor_pb(ex: ExecutorStats) -> scheduler_pb2.ExecutorStats:
    return scheduler_pb2.ExecutorStats(
        address=ex.address, running=ex.running, free_kv_blocks=ex.free_kv_blocks,
        num_kv_blocks=ex.num_kv_blocks, steps=ex.num_steps, adapter_loads=ex.num_loads,
        adapter_hits=ex.num_hits, queued=ex.queued, is_draining=ex.is_draining,
        is_drained=ex.is_drained, is_up=ex.is_up, cached_kv_blocks=ex.cached_kv_blocks,
        dedicated_to=adapter_pb(ex.dedicated_to), is_merged=ex.is_merged,
        slots=[scheduler_pb2.SlotStats(adapter=adapter_pb(s.adapter), state=s.state.value,
                                       pins=s.pins, is_admin_pinned=s.is_admin_pinned,
                                       reserved_for=adapter_pb(s.reserved_for),
                                       num_pages=s.num_pages)
               for s in ex.slots],
        adapter_pages=ex.adapter_pages, page_bytes=ex.page_bytes,
        adapter_evictions=ex.num_evictions, adapter_early_evictions=ex.num_early_evictions,
        kv_blocks_behind_windows=ex.kv_blocks_behind_windows,
        decode_graph_buckets=ex.graph_buckets, decode_graphs_off=ex.graphs_off,
        preemptions=ex.num_preemptions,
        **_quantized_pb(ex.quantized))


def _quantized_pb(q: QuantizedBase | None) -> dict:
    if q is None:
        return {}
    return dict(quantization=q.description, quantized_freed_bytes=q.freed_bytes,
                quantized_freed_kv_tokens=q.freed_kv_tokens, quantized_freed_blocks=q.freed_blocks)


def _tenant_pb(t: TenantStats) -> scheduler_pb2.TenantStats:
    return scheduler_pb2.TenantStats(
        tenant=t.tenant, queued=t.queued, running=t.running, virtual_counter=t.virtual_counter,
        requests=t.totals.requests, prompt_tokens=t.totals.prompt_tokens,
        completion_tokens=t.totals.completion_tokens,
        adapter_loads_caused=t.totals.adapter_loads_caused,
        cached_prompt_tokens=t.totals.cached_prompt_tokens)
