"""The executor's Prometheus metrics (its /metrics port, --metrics-port)."""

from prometheus_client import CollectorRegistry, Counter, Histogram


class ExecutorMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.step = Histogram(
            "loraplex_executor_step_seconds", "Forward pass and sampling of one step.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        self.rows = Counter("loraplex_executor_tokens",
                            "Tokens computed (prefill and decode rows).", registry=r)
        self.loads = Counter("loraplex_executor_adapter_loads", "Adapters loaded into slots.",
                             registry=r)
        self.load = Histogram(
            "loraplex_executor_adapter_load_seconds", "Fetch, parse and copy of one load.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.load_bytes = Counter("loraplex_executor_adapter_load_bytes", "Adapter bytes fetched.",
                                  registry=r)
        self.graph_steps = Counter("loraplex_executor_graph_steps",
                                   "Decode steps replayed from a CUDA graph.", registry=r)
