"""Scheduler configuration: one frozen dataclass, validated at construction."""

import argparse
from dataclasses import dataclass, field, fields

from common import wire
from common.credentials import KeySources, add_key_arguments, sources_from_args
from common.ratelimit import RateLimit, add_rate_limit_arguments, rate_limits_from_args
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits
from scheduler.timeouts import Timeouts


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
        p = argparse.ArgumentParser(prog="loraplex serve scheduler")
        p.add_argument("--executor", action="append", default=[],
                       help="executor host:port, dns:///name:port (all its addresses) or "
                            "file:///path (one address per line); repeatable, re-resolved "
                            "periodically")
        p.add_argument("--discovery-interval-s", type=float, default=5.0)
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
        p.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=W")
        add_rate_limit_arguments(p)
        p.add_argument("--load-weight", type=float, default=FairnessWeights.load_weight,
                       help="how much of an adapter load's time a tenant pays, in "
                            "token-equivalents")
        for f in (*fields(Limits), *fields(Timeouts)):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
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
