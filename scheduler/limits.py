"""The limits one pool's scheduler works under: one frozen record, checked when made (the
scheduler's configuration, scheduler/config.py, fills it from flags)."""

from dataclasses import dataclass

from scheduler.steps.prefix_cache import SCOPES


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int = 64  # running sequences per executor
    max_batched_tokens: int = 2048  # tokens per step per executor (long prompts are chunked)
    max_adapters_per_batch: int = 0  # distinct adapters running at once per executor; 0 = no limit
    # A request running on an executor that fails (a step errors, the stream or process dies) is
    # recomputed elsewhere; the time this many executors failed under it, it fails too: a request
    # whose step always fails must not bring executors down forever.
    max_executor_failures: int = 3
    affinity_max_wait_s: float = 0.0  # prefer requests whose adapter runs, for at most this long
    # Anti-starvation: a tenant's oldest request on an executor that has waited this long for
    # an adapter in no slot there has it brought in before anyone is admitted, even while its
    # tenant has other requests that can start: into an empty or evictable slot, else a slot
    # drains for it (within max_reserved_slots, the longest waiting first). 0 = off, and a
    # cold adapter gets a slot only when its tenant has nothing else to run or one frees as it
    # asks. (admission.py; bench/affinity.py measured it.)
    starvation_wait_s: float = 5.0
    slot_wait_s: float = 2.0  # routing: expected wait when every slot of an executor is pinned
    home_bias_s: float = 2.0  # routing: how much busier a cold adapter's home may be and still win
    popularity_half_life_s: float = 60.0  # eviction: decay of adapters' request counts
    max_reserved_slots: int = 1  # slots per executor that may drain for a waiting adapter
    # Adapters' pages and KV share each executor's blocks (residency/adapter_memory.py): a load
    # may take free or cached blocks only while this share of the blocks stays free for KV; KV
    # takes blocks back from adapters nobody uses or waits for whenever it needs them.
    kv_reserve: float = 0.1
    # Adapter slots per executor that operators' pins (Prewarm with pin) leave to every other
    # adapter: a pin beyond is refused (FAILED_PRECONDITION), so unpinned adapters keep a slot
    # to take turns in and a bounded wait. 0 lets pins take every slot.
    unpinned_slots: int = 1
    # A tenant more than this many token-equivalents ahead of the least-served backlogged tenant is
    # not admitted (even if that tenant waits for a load): bounds the fairness gap; 0 = no bound.
    fairness_window: float = 8192.0
    # A load that failed retryably (UNAVAILABLE: a store or S3 down or frozen) is tried again
    # after load_backoff_s, doubling up to max_load_backoff_s; its requests wait meanwhile,
    # within their deadlines and max_queue_s. Any other failure fails them at once.
    load_backoff_s: float = 0.5
    max_load_backoff_s: float = 10.0
    # A request waits at most this long for its adapter's fetch onto its executor (a load or a
    # staging under way, or failing and backing off): then it ends UNAVAILABLE with retry-after,
    # so a frozen store or S3 never leaves a cold request silent for longer. A wait for a slot
    # to free (no fetch under way) is bounded by max_queue_s.
    max_load_wait_s: float = 30.0
    # A request not admitted within this long is refused (RESOURCE_EXHAUSTED with retry-after;
    # UNAVAILABLE when its adapter keeps failing to load), also while no executor is up.
    max_queue_s: float = 300.0
    # Requests one tenant may have waiting; one more is refused at once (RESOURCE_EXHAUSTED with
    # retry-after). 0 = no cap.
    max_queued_per_tenant: int = 1024
    # Steps sent to an executor before the oldest one's answer is read (engine.py): at 2 the next
    # step is planned and sent while the executor runs this one, so it never waits between
    # steps; 1 = one at a time.
    pipeline_depth: int = 2
    # Prefix caching (steps/prefix_cache.py): "tenant" reuses KV blocks within a tenant (and adapter
    # version and cache salt), "pool" across tenants too, "off" never.
    prefix_cache: str = "tenant"
    # Automatic merging (merging.py): an adapter whose share of the pool's tokens stays at least
    # merge_share for merge_window_s is merged into one executor's weights (with >= 2 executors
    # up, never the last serving everyone); merged, once its share stays below unmerge_share
    # for a window, it is unmerged. 0 = only the admin Merge RPC merges.
    merge_share: float = 0.0
    unmerge_share: float = 0.5
    merge_window_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.merge_share <= 1 or not 0 <= self.unmerge_share <= 1:
            raise ValueError("merge_share and unmerge_share must be in [0, 1]")
        if self.merge_share and self.unmerge_share >= self.merge_share:
            raise ValueError(f"unmerge_share ({self.unmerge_share}) must be below merge_share "
                             f"({self.merge_share}): the gap is the hysteresis")
        if not self.merge_window_s > 0:
            raise ValueError(f"merge_window_s must be > 0, got {self.merge_window_s}")
        if self.prefix_cache not in SCOPES:
            raise ValueError(f"prefix_cache must be one of {', '.join(SCOPES)}, got "
                             f"{self.prefix_cache!r}")
        if not 0 <= self.kv_reserve < 1:
            raise ValueError(f"kv_reserve must be in [0, 1), got {self.kv_reserve}")
        if self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {self.pipeline_depth}")
        if self.popularity_half_life_s <= 0:
            raise ValueError("popularity_half_life_s must be > 0, got "
                             f"{self.popularity_half_life_s}")
        for name in ("max_num_seqs", "max_batched_tokens", "max_executor_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler limit {name} must be >= 1, got {getattr(self, name)}")
        for name in ("load_backoff_s", "max_queue_s", "max_load_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"scheduler limit {name} must be > 0, got {getattr(self, name)}")
        if self.max_load_backoff_s < self.load_backoff_s:
            raise ValueError("max_load_backoff_s must be >= load_backoff_s")
        for name in ("max_adapters_per_batch", "affinity_max_wait_s", "starvation_wait_s",
                     "slot_wait_s", "max_reserved_slots", "unpinned_slots", "fairness_window",
                     "home_bias_s", "max_queued_per_tenant"):
            if getattr(self, name) < 0:
                raise ValueError(f"scheduler limit {name} must be >= 0, got {getattr(self, name)}")
