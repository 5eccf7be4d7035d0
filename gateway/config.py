"""Gateway configuration: one frozen dataclass, from flags (keys from files or the environment,
never flags)."""

import argparse
from dataclasses import dataclass, field

from common.credentials import KeySources, add_key_arguments, sources_from_args
from common.help_format import HelpFormatter
from common.ratelimit import RateLimit, add_rate_limit_arguments, rate_limits_from_args
from gateway.pools import parse_pool

# The gateway's deadlines and intervals, in seconds, as --help describes them.
_SECONDS = {
    "refresh_s": "how often each pool's schedulers are probed, host names resolved again and "
                 "the --roster file read",
    "rpc_s": "deadline of each probe and registry lookup",
    "resolve_ttl_s": "an adapter name's or alias's resolution is reused this long",
    "request_timeout_s": "a request's deadline when its client sets none",
    "grace_s": "on SIGTERM, requests under way get this long to finish",
}


@dataclass(frozen=True)
class GatewayConfig:
    address: str = "0.0.0.0:50050"  # gRPC (the scheduler's Generate contract)
    http_address: str = "0.0.0.0:8000"  # HTTP (OpenAI API)
    pools: dict[str, list[str]] = field(default_factory=dict)  # base model id -> schedulers
    roster: str = ""  # file of "MODEL_ID HOST:PORT ..." lines, read again when it changes
    stores: tuple[str, ...] = ()  # adapter store replicas (resolution, /v1/models)
    keys: KeySources = KeySources()
    rate_limits: dict[str, RateLimit] = field(default_factory=dict)
    default_rate_limit: RateLimit = RateLimit()
    refresh_s: float = 2.0  # pools' cells probed, names resolved, roster read
    rpc_s: float = 2.0  # probes and registry lookups
    resolve_ttl_s: float = 1.0  # names and aliases resolved again after this
    request_timeout_s: float = 600.0  # a request's deadline when the client sets none
    max_body_mb: int = 32
    metrics_port: int = 0
    grace_s: float = 30.0  # in-flight requests finish within this on SIGTERM

    def __post_init__(self):
        if not self.pools and not self.roster:
            raise ValueError("gateway: configure pools with --pool MODEL_ID=HOST:PORT or "
                             "--roster FILE")
        if not self.stores:
            raise ValueError("gateway: at least one --store (adapter resolution)")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "GatewayConfig":
        p = argparse.ArgumentParser(prog="loraplex serve gateway", formatter_class=HelpFormatter,
                                    description="loraplex gateway: OpenAI HTTP API and gRPC "
                                                "Generate in front of the pools")
        p.add_argument("--address", default=cls.address, help="gRPC host:port")
        p.add_argument("--http-address", default=cls.http_address, help="HTTP host:port")
        p.add_argument("--pool", action="append", default=[],
                       metavar="MODEL_ID=HOST:PORT[,HOST:PORT]",
                       help="a pool: its base model and its schedulers (repeatable)")
        p.add_argument("--roster", default="", help="file of 'MODEL_ID HOST:PORT ...' lines")
        p.add_argument("--store", action="append", default=[], help="adapter store host:port")
        add_key_arguments(p)
        add_rate_limit_arguments(p)
        for name, help in _SECONDS.items():
            p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(cls, name),
                           help=help)
        p.add_argument("--max-body-mb", type=int, default=cls.max_body_mb,
                       help="largest HTTP request body, in MiB (a 400 past it)")
        p.add_argument("--metrics-port", type=int, default=0,
                       help="Prometheus /metrics port (0 = off)")
        a = p.parse_args(argv)
        pools: dict[str, list[str]] = {}
        for text in a.pool:
            model_id, hosts = parse_pool(text)
            pools.setdefault(model_id, []).extend(hosts)
        rates, default_rate = rate_limits_from_args(a)
        return cls(address=a.address, http_address=a.http_address, pools=pools,
                   roster=a.roster, stores=tuple(a.store), keys=sources_from_args(a),
                   rate_limits=rates, default_rate_limit=default_rate, refresh_s=a.refresh_s,
                   rpc_s=a.rpc_s, resolve_ttl_s=a.resolve_ttl_s,
                   request_timeout_s=a.request_timeout_s, max_body_mb=a.max_body_mb,
                   metrics_port=a.metrics_port, grace_s=a.grace_s)
