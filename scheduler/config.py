"""Scheduler configuration: one frozen dataclass, validated at construction."""

import argparse
from dataclasses import dataclass, field

from scheduler.core import Limits
from scheduler.fairness import FairnessWeights


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
    api_keys: dict[str, str] = field(default_factory=dict)  # api key -> tenant; empty = open access
    weights: FairnessWeights = field(default_factory=FairnessWeights)
    limits: Limits = field(default_factory=Limits)
    default_max_new_tokens: int = 16
    max_stop_strings: int = 16
    max_stop_chars: int = 256

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
        p.add_argument("--executor", action="append", default=[], help="executor host:port (repeatable)")
        p.add_argument("--store", action="append", default=[], help="adapter store host:port (repeatable)")
        p.add_argument("--address", default="127.0.0.1:0", help="host:port to listen on (port 0 = any)")
        p.add_argument("--api-key", action="append", default=[], metavar="KEY=TENANT",
                       help="accept KEY for TENANT (repeatable); none = open access as tenant 'default'")
        p.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=W")
        p.add_argument("--max-num-seqs", type=int, default=Limits.max_num_seqs)
        p.add_argument("--max-batched-tokens", type=int, default=Limits.max_batched_tokens)
        a = p.parse_args(argv)
        weights = {t: float(w) for t, w in _pairs(a.tenant_weight, "--tenant-weight").items()}
        return cls(executors=tuple(a.executor), stores=tuple(a.store), address=a.address,
                   api_keys=_pairs(a.api_key, "--api-key"),
                   weights=FairnessWeights(tenant_weights=weights),
                   limits=Limits(max_num_seqs=a.max_num_seqs, max_batched_tokens=a.max_batched_tokens))
