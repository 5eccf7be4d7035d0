"""The scheduler's Prometheus metrics: request latencies and step shapes as histograms, and the
core's counters (loads, hits, evictions, virtual counters) read from its state at scrape time."""

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.metrics import BoundedLabel
from scheduler.core import Scheduler
from scheduler.operators import Operators
from scheduler.request import Request
from scheduler.residency.slots import SlotState
from scheduler.steps.sequence import StepPlan

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class SchedulerMetrics:
    def __init__(self, core: Scheduler, tenant_limit: int = 50):
        self.registry = CollectorRegistry()
        self.tenant = BoundedLabel(tenant_limit)
        r = self.registry
        self.ttft = Histogram("loraplex_time_to_first_token_seconds", "Arrival to first token.",
                              ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("loraplex_time_per_output_token_seconds",
                              "Mean time between output tokens.", ["tenant"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("loraplex_queue_seconds", "Arrival to admission.", ["tenant"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("loraplex_tokens", "Tokens served (kind: prompt, completion, and "
                              "cached_prompt: the prompt tokens the prefix cache held).",
                              ["tenant", "kind"], registry=r)
        self.step = Histogram("loraplex_step_seconds", "Executor step time (forward + sampling).",
                              ["executor"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("loraplex_step_rows", "Rows (sequences) per step.", ["executor"],
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.adapters = Histogram("loraplex_step_distinct_adapters", "Distinct adapters per step.",
                                  ["executor"], buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128),
                                  registry=r)
        self.load = Histogram("loraplex_adapter_load_seconds",
                              "Adapter load time, request to slot ready.", ["executor"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.host_prewarms = Counter(
            "loraplex_host_prewarms", "Adapters a store was asked to bring into RAM while their "
            "requests waited for a slot.", registry=r)
        self.alora_inactive = Counter(
            "loraplex_alora_inactive", "Requests that named an activated LoRA whose invocation "
            "their prompt does not hold (served by the base model, as PEFT would).", ["tenant"],
            registry=r)
        r.register(_CoreCollector(core, self.tenant))

    def on_alora_inactive(self, tenant: str) -> None:
        self.alora_inactive.labels(self.tenant(tenant)).inc()

    def on_step(self, executor: str, plan: StepPlan, seconds: float) -> None:
        self.step.labels(executor).observe(seconds)
        self.batch.labels(executor).observe(len(plan.rows))
        self.adapters.labels(executor).observe(plan.num_adapters)

    def on_finish(self, req: Request, now: float) -> None:
        tenant = self.tenant(req.ask.tenant)
        self.tokens.labels(tenant, "prompt").inc(len(req.ask.prompt_ids))
        self.tokens.labels(tenant, "completion").inc(req.output.num_tokens)
        self.tokens.labels(tenant, "cached_prompt").inc(req.charges.cached_prompt_tokens)
        if req.admitted_at is not None:
            self.queue.labels(tenant).observe(req.admitted_at - req.arrival)
        if req.first_token_at is not None:
            self.ttft.labels(tenant).observe(req.first_token_at - req.arrival)
            if req.output.num_tokens > 1:
                seconds = (now - req.first_token_at) / (req.output.num_tokens - 1)
                self.tpot.labels(tenant).observe(seconds)


class _CoreCollector:
    """Reads the scheduler core's own counters when Prometheus scrapes (its Stats snapshot)."""

    def __init__(self, core: Scheduler, tenant: BoundedLabel):
        self._core, self._operators, self._tenant = core, Operators(core), tenant

    def collect(self):
        executors = self._operators.stats().executors
        per_executor = {
            "loraplex_adapter_loads": ("Adapter loads completed.", "num_loads"),
            "loraplex_adapter_hits": ("Admissions that found their adapter resident.",
                                      "num_hits"),
            "loraplex_adapter_evictions": ("Adapters evicted to make room.", "num_evictions"),
            "loraplex_adapter_early_evictions": (
                "Adapters evicted before they served anyone since their load (churn: loaded "
                "again for the requests they were loaded for).",
                "num_early_evictions"),
            "loraplex_steps": ("Steps run.", "num_steps"),
            "loraplex_preemptions": ("Running sequences preempted for KV (recomputed later).",
                                     "num_preemptions"),
        }
        for name, (doc, attr) in per_executor.items():
            family = CounterMetricFamily(name, doc, labels=["executor"])
            for ex in executors:
                family.add_metric([ex.address], getattr(ex, attr))
            yield family
        running = GaugeMetricFamily("loraplex_running_sequences", "Sequences running.",
                                    labels=["executor"])
        queued = GaugeMetricFamily("loraplex_queued_requests", "Requests queued.",
                                   labels=["executor"])
        free = GaugeMetricFamily("loraplex_free_kv_blocks", "Free KV blocks (cached ones in no "
                                 "sequence's table included).", labels=["executor"])
        cached = GaugeMetricFamily("loraplex_cached_kv_blocks",
                                   "KV blocks holding a cached prefix.", labels=["executor"])
        pages = GaugeMetricFamily("loraplex_adapter_pages", "KV blocks holding adapters' weights "
                                  "(their pages).", labels=["executor"])
        resident = GaugeMetricFamily("loraplex_resident_adapters", "Adapters loaded or loading.",
                                     labels=["executor"])
        page_bytes = GaugeMetricFamily("loraplex_adapter_page_bytes", "Bytes of adapters' pages "
                                       "(over resident adapters: bytes per adapter).",
                                       labels=["executor"])
        behind = GaugeMetricFamily("loraplex_kv_blocks_behind_windows", "KV blocks the running "
                                   "sequences do not hold because sliding-window layers keep "
                                   "only their window.", labels=["executor"])
        for ex in executors:
            running.add_metric([ex.address], ex.running)
            queued.add_metric([ex.address], ex.queued)
            free.add_metric([ex.address], ex.free_kv_blocks)
            cached.add_metric([ex.address], ex.cached_kv_blocks)
            pages.add_metric([ex.address], ex.adapter_pages)
            resident.add_metric([ex.address], sum(
                1 for slot in ex.slots if slot.state in (SlotState.LOADING, SlotState.READY)))
            page_bytes.add_metric([ex.address], ex.adapter_pages * ex.page_bytes)
            behind.add_metric([ex.address], ex.kv_blocks_behind_windows)
        yield from (running, queued, free, cached, pages, resident, page_bytes, behind)
        hit_rate = GaugeMetricFamily(
            "loraplex_prefix_cache_hit_rate", "Of the prompt tokens of each tenant's ended "
            "requests, the fraction the prefix cache held.", labels=["tenant"])
        rates: dict[str, list[int]] = {}
        for tenant, totals in self._core.totals.items():
            label = rates.setdefault(self._tenant(tenant), [0, 0])
            label[0] += totals.cached_prompt_tokens
            label[1] += totals.prompt_tokens
        for label, (hits, prompt) in sorted(rates.items()):
            hit_rate.add_metric([label], hits / prompt if prompt else 0.0)
        yield hit_rate
        counters = GaugeMetricFamily("loraplex_tenant_virtual_counter",
                                     "Virtual-time counter of each tenant (token-equivalents).",
                                     labels=["tenant"])
        by_label: dict[str, float] = {}
        for tenant, value in self._core.fair.counters.items():
            label = self._tenant(tenant)
            by_label[label] = max(by_label.get(label, 0.0), value)
        for label, value in sorted(by_label.items()):
            counters.add_metric([label], value)
        yield counters
