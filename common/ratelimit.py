"""Per-tenant rate limits: token buckets for requests per second and tokens per second.

A request costs 1 from the request bucket and (prompt + max_new_tokens) from the token bucket; it
passes only when both can pay, and gets back the new tokens it did not make when it ends (a chat
with no max_tokens may reach the end of the context: it pays for what it made). A bucket holds
`burst_s` seconds of its rate; a full bucket lets any single request through (going into debt),
so a large request is slowed, never refused forever. Limits hold per process: N gateway
replicas admit up to N times a tenant's limit in all.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import ResourceExhausted, retry_after


@dataclass(frozen=True)
class RateLimit:
    requests_per_s: float = 0.0  # 0 = unlimited
    tokens_per_s: float = 0.0  # 0 = unlimited
    burst_s: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "RateLimit":
        """'RPS:TPS', e.g. '5:2000' (0 = unlimited)."""
        try:
            rps, tps = (float(x) for x in text.split(":"))
        except ValueError:
            raise ValueError("rate limit must look like REQUESTS_PER_S:TOKENS_PER_S, got "
                             f"{text!r}") from None
        if rps < 0 or tps < 0:
            raise ValueError(f"rate limits must be >= 0, got {text!r}")
        return cls(rps, tps)


def add_rate_limit_arguments(parser) -> None:
    """--rate-limit TENANT=RPS:TPS (repeatable) and --default-rate-limit RPS:TPS (argparse)."""
    parser.add_argument("--rate-limit", action="append", default=[], metavar="TENANT=RPS:TPS",
                        help="per-tenant requests/s and tokens/s (0 = unlimited)")
    parser.add_argument("--default-rate-limit", default="0:0", metavar="RPS:TPS",
                        help="tenants without a --rate-limit of their own (0:0 = unlimited)")


def rate_limits_from_args(args) -> tuple[dict[str, RateLimit], RateLimit]:
    """(per-tenant limits, the default) from the flags of add_rate_limit_arguments."""
    limits = {}
    for item in args.rate_limit:
        tenant, sep, rate = item.partition("=")
        if not sep or not tenant:
            raise ValueError(f"--rate-limit must look like TENANT=RPS:TPS, got {item!r}")
        limits[tenant] = RateLimit.parse(rate)
    return limits, RateLimit.parse(args.default_rate_limit)


class TokenBucket:
    def __init__(self, rate: float, burst_s: float, now: float):
        self.rate, self.capacity = rate, rate * burst_s
        self.level, self.updated = self.capacity, now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` can be paid (0 = now)."""
        if not self.rate or self.level >= min(amount, self.capacity):
            return 0.0
        return (min(amount, self.capacity) - self.level) / self.rate

    def pay(self, amount: float) -> None:
        if self.rate:
            self.level -= amount

    def give_back(self, amount: float) -> None:
        if self.rate:
            self.level = min(self.capacity, self.level + amount)


class RateLimiter:
    def __init__(self, limits: dict[str, RateLimit], default: RateLimit = RateLimit(),
                 clock: Callable[[], float] = time.monotonic):
        self._limits, self._default, self._clock = limits, default, clock
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}

    def admit(self, tenant: str, num_tokens: int) -> None:
        """Pay for a request, or raise RESOURCE_EXHAUSTED with a retry-after (seconds) trailer."""
        limit = self._limits.get(tenant, self._default)
        if not (limit.requests_per_s or limit.tokens_per_s):
            return
        now = self._clock()
        if tenant not in self._buckets:
            self._buckets[tenant] = (TokenBucket(limit.requests_per_s, limit.burst_s, now),
                                     TokenBucket(limit.tokens_per_s, limit.burst_s, now))
        requests, tokens = self._buckets[tenant]
        requests.refill(now)
        tokens.refill(now)
        wait = max(requests.wait_for(1), tokens.wait_for(num_tokens))
        if wait > 0:
            err = ResourceExhausted(f"tenant {tenant!r} is over its rate limit "
                                    f"({limit.requests_per_s:g} requests/s, "
                                    f"{limit.tokens_per_s:g} tokens/s); retry in {wait:.2f}s")
            raise retry_after(err, wait)
        requests.pay(1)
        tokens.pay(num_tokens)

    def refund(self, tenant: str, num_tokens: int) -> None:
        """Give back tokens a request paid for and did not use (its max_new_tokens past the
        tokens it made), up to a full bucket."""
        buckets = self._buckets.get(tenant)
        if buckets is not None and num_tokens > 0:
            buckets[1].give_back(num_tokens)
