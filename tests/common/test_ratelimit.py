"""Per-tenant token buckets (requests/s and tokens/s)."""

import pytest

from common.errors import ResourceExhausted
from common.ratelimit import RateLimit, RateLimiter


def test_buckets_refill_at_their_rate_and_say_when_to_retry():
    now = [0.0]
    limiter = RateLimiter({"a": RateLimit(requests_per_s=2, tokens_per_s=100)},
                          clock=lambda: now[0])
    limiter.admit("a", 10)
    limiter.admit("a", 10)
    with pytest.raises(ResourceExhausted) as info:
        limiter.admit("a", 10)
    assert dict(info.value.trailers)["retry-after"] == "0.500"
    now[0] = 0.5
    limiter.admit("a", 10)
    limiter.admit("b", 10**6)  # tenants without a limit are never held back


def test_a_full_bucket_lets_one_large_request_through_then_makes_it_wait():
    now = [0.0]
    limiter = RateLimiter({}, default=RateLimit(tokens_per_s=100), clock=lambda: now[0])
    limiter.admit("a", 500)  # larger than the bucket: allowed once, into debt
    with pytest.raises(ResourceExhausted):
        limiter.admit("a", 1)
    now[0] = 5.0
    limiter.admit("a", 1)


def test_tokens_a_request_did_not_make_come_back_up_to_a_full_bucket():
    now = [0.0]
    limiter = RateLimiter({}, default=RateLimit(tokens_per_s=100), clock=lambda: now[0])
    limiter.admit("a", 90)  # prompt 10 + max_new_tokens 80
    with pytest.raises(ResourceExhausted):
        limiter.admit("a", 90)
    limiter.refund("a", 80)  # it made none of its 80 (its prompt stays paid)
    limiter.admit("a", 90)
    limiter.refund("a", 10**6)  # never past a full bucket
    limiter.admit("a", 100)
    with pytest.raises(ResourceExhausted):
        limiter.admit("a", 1)
    limiter.refund("b", 50)  # (a tenant with no bucket yet: nothing to give back)


@pytest.mark.parametrize("text", ["5", "a:b", "-1:3"])
def test_bad_rate_limit_text_is_refused(text):
    with pytest.raises(ValueError):
        RateLimit.parse(text)
