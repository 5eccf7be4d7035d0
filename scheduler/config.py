"""Scheduler configuration: one frozen dataclass, validated at construction."""

import argparse
from dataclasses import dataclass, field, fields

from common import wire
from common.credentials import KeySources, add_key_arguments, sources_from_args
from common.help_format import HelpFormatter
from common.ratelimit import RateLimit, add_rate_limit_arguments, rate_limits_from_args
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.timeouts import Timeouts

# The help of each Limits and Timeouts flag (--max-num-seqs for max_num_seqs); their fields'
# comments (limits.py, timeouts.py) say more.
FLAG_HELP = {
    "max_num_seqs": "running sequences per executor",
    "max_batched_tokens": "tokens per step per executor (longer prompts are prefilled in chunks)",
    "max_adapters_per_batch": "distinct adapters running at once per executor (0 = no limit)",
    "max_executor_failures": "a request is recomputed elsewhere when its executor fails; it "
                             "fails too once this many executors failed under it",
    "affinity_max_wait_s": "requests whose adapter is running go ahead of older ones for at "
                           "most this long (0 = off)",
    "starvation_wait_s": "a tenant's oldest request that has waited this long for an adapter "
                         "in no slot has it brought in before anyone else is admitted, a slot "
                         "drained for it if need be (0 = off)",
    "slot_wait_s": "routing: the wait expected at an executor whose every slot is pinned",
    "home_bias_s": "routing: how much longer a cold adapter's home executor may make it wait "
                   "and still be chosen",
    "popularity_half_life_s": "eviction: half-life of adapters' request counts",
    "max_reserved_slots": "slots per executor that may drain for a waiting adapter",
    "kv_reserve": "share of each executor's blocks that adapter loads leave free for KV",
    "unpinned_slots": "adapter slots per executor that operators' pins (loraplex admin prewarm "
                      "--pin) leave to every other adapter (0 = pins may take them all)",
    "fairness_window": "a tenant this many token-equivalents ahead of the least-served waiting "
                       "tenant is not admitted (0 = no bound)",
    "load_backoff_s": "a load that failed retryably (a store or S3 down) is tried again after "
                      "this long, doubling each time",
    "max_load_backoff_s": "the longest wait between tries of a failing load",
    "max_load_wait_s": "a request waits at most this long for its adapter's fetch onto its "
                       "executor, then ends UNAVAILABLE with retry-after",
    "max_queue_s": "a request not admitted within this long is refused (RESOURCE_EXHAUSTED "
                   "with retry-after)",
    "max_queued_per_tenant": "requests one tenant may have waiting; one more is refused "
                             "(0 = no cap)",
    "pipeline_depth": "steps sent to an executor before the oldest one's answer is read "
                      "(1 = one at a time)",
    "prefix_cache": "reuse of prompts' KV blocks: tenant (within a tenant, adapter version and "
                    "cache salt), pool (across tenants too) or off",
    "merge_share": "an adapter whose share of the pool's tokens stays at least this for "
                   "--merge-window-s is merged into one executor's weights (0 = only the admin "
                   "Merge RPC merges)",
    "unmerge_share": "a merged adapter whose share stays below this for --merge-window-s is "
                     "unmerged",
    "merge_window_s": "how long a share must hold before a merge or an unmerge",
    "rpc_s": "seconds an executor has to answer Info, UnloadAdapter and probes",
    "step_floor_s": "seconds an executor has to answer a step, at least: one that misses it is "
                    "suspect and its sequences are recomputed elsewhere",
    "step_factor": "a step's deadline in multiples of its expected time (from the executor's "
                   "measured token rate), when above --step-floor-s",
    "step_warmup_s": "seconds an executor has for each of its first --warmup-steps steps "
                     "(kernels compile on a GPU)",
    "warmup_steps": "steps after an executor connects that have --step-warmup-s",
    "probe_interval_s": "an idle executor is sent an empty step this often",
    "load_floor_s": "seconds an executor has to fetch and place an adapter, at least",
    "load_factor": "a load's deadline in multiples of its expected time (from the measured load "
                   "bandwidth), when above --load-floor-s",
    "resolve_s": "seconds an adapter store replica has to answer a lookup",
    "resolve_ttl_s": "adapter names and aliases are resolved again once their answer is this old",
    "warm_s": "seconds a store has to warm an adapter into its RAM tier",
    "merge_s": "seconds more for a step that merges or unmerges an adapter",
    "stream_write_s": "a gateway's Stream that takes no message this long ends, its requests "
                      "cancelled",
}


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"scheduler: {what} must look like KEY=VALUE, got {item!r}")
        out[key] = value
    return out


@dataclass(frozen=True)
class SchedulerConfig:
    executors: tuple[str, ...]  # executor addresses
    stores: tuple[str, ...]  # adapter store addresses (registry lookups), tried in order
    address: str = "127.0.0.1:0"
    metrics_port: int = 0  # Prometheus endpoint; 0 = off
    grace_s: float = 30.0  # on SIGTERM: how long in-flight work may take to finish
    # Where tenant, admin and service keys are read (files, LORAPLEX_* env); none = open access
    # as tenant "default" (common/credentials.py).
    keys: KeySources = KeySources()
    rate_limits: dict[str, RateLimit] = field(default_factory=dict)  # per tenant
    default_rate_limit: RateLimit = RateLimit()  # tenants without their own (0:0 = unlimited)
    weights: FairnessWeights = field(default_factory=FairnessWeights)
    limits: Limits = field(default_factory=Limits)
    timeouts: Timeouts = field(default_factory=Timeouts)
    discovery_interval_s: float = 5.0  # how often executor names are re-resolved
    timings_out: str = ""  # append a JSON line per step and per load here (scheduler/timings.py)
    max_stop_strings: int = wire.MAX_STOP_STRINGS
    max_stop_chars: int = wire.MAX_STOP_CHARS

    def __post_init__(self) -> None:
        if not self.executors:
            raise ValueError("scheduler: at least one executor address is required (--executor)")
        if not self.stores:
            raise ValueError("scheduler: at least one adapter store address is required (--store)")
        for tenant, w in self.weights.tenant_weights.items():
            if not w > 0:
                raise ValueError(f"scheduler: tenant weight of {tenant!r} must be > 0, got {w}")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "SchedulerConfig":
        p = argparse.ArgumentParser(prog="loraplex serve scheduler", formatter_class=HelpFormatter,
                                    description="loraplex scheduler: one pool's queues, fairness, "
                                                "admission and adapter residency over its "
                                                "executors")
        p.add_argument("--executor", action="append", default=[],
                       help="executor host:port, dns:///name:port (all its addresses) or "
                            "file:///path (one address per line); repeatable, re-resolved "
                            "periodically")
        p.add_argument("--discovery-interval-s", type=float, default=5.0,
                       help="how often executor names (dns:///, file:///) are resolved again")
        p.add_argument("--store", action="append", default=[],
                       help="adapter store host:port (repeatable)")
        p.add_argument("--address", default="127.0.0.1:0",
                       help="host:port to listen on (port 0 = any)")
        p.add_argument("--metrics-port", type=int, default=0,
                       help="Prometheus /metrics port (0 = off)")
        p.add_argument("--grace-s", type=float, default=30.0,
                       help="on SIGTERM, time to finish in-flight work")
        p.add_argument("--timings-out", default="", metavar="PATH",
                       help="append each step's and load's measured time here, for "
                            "`loraplex fit-cost`")
        add_key_arguments(p)
        p.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=W",
                       help="a tenant's weight in fair sharing (repeatable; default 1)")
        add_rate_limit_arguments(p)
        p.add_argument("--load-weight", type=float, default=FairnessWeights.load_weight,
                       help="how much of an adapter load's time a tenant pays, in "
                            "token-equivalents")
        for f in (*fields(Limits), *fields(Timeouts)):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                           help=FLAG_HELP[f.name])
        a = p.parse_args(argv)
        weights = {t: float(w) for t, w in _pairs(a.tenant_weight, "--tenant-weight").items()}
        rates, default_rate = rate_limits_from_args(a)
        return cls(executors=tuple(a.executor), stores=tuple(a.store), address=a.address,
                   discovery_interval_s=a.discovery_interval_s, metrics_port=a.metrics_port,
                   grace_s=a.grace_s, timings_out=a.timings_out,
                   keys=sources_from_args(a),
                   rate_limits=rates, default_rate_limit=default_rate,
                   weights=FairnessWeights(load_weight=a.load_weight, tenant_weights=weights),
                   limits=Limits(**{f.name: getattr(a, f.name) for f in fields(Limits)}),
                   timeouts=Timeouts(**{f.name: getattr(a, f.name) for f in fields(Timeouts)}))
