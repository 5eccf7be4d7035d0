"""Where a request should run: the executor with the least expected time until it can start.

    score(ex) = queued and running work on ex / ex's token rate      (seconds of work ahead)
              + time to bring the adapter in, if ex does not hold it  (bytes / load bandwidth)
              + slot_wait_s, if every slot of ex is pinned            (it must wait for one)

              + home_bias_s, if ex is not the adapter's home and does not hold it

Both rates are measured (exponential moving averages of step and load timings), so a busy
executor holding the adapter loses to an idle one once its backlog outweighs a load: that is how
a hot adapter gets replicated as its traffic grows. A cold adapter goes to its home executor
(rendezvous hashing) unless that one is `home_bias_s` busier: executors then cache different
adapters instead of the same popular ones, so the pool's slots add up.
"""

import hashlib
import math
from dataclasses import dataclass, field

from common.adapter_ref import AdapterRef

EMA = 0.2  # weight of the newest measurement


@dataclass
class Rates:
    """Measured speeds of one executor."""

    tokens_per_second: float = 2000.0
    load_bytes_per_second: float = 1e9
    load_latency_s: float = 0.005

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens and seconds > 0:
            self.tokens_per_second += EMA * (num_tokens / seconds - self.tokens_per_second)

    def observe_load(self, num_bytes: int, seconds: float) -> None:
        if num_bytes and seconds > 0:
            self.load_bytes_per_second += EMA * (num_bytes / seconds - self.load_bytes_per_second)

    def load_seconds(self, num_bytes: int) -> float:
        return self.load_latency_s + num_bytes / self.load_bytes_per_second


def score(work_tokens: float, rates: Rates, is_resident: bool, can_place: bool, adapter_bytes: int,
          slot_wait_s: float, away_s: float = 0.0) -> float:
    """Expected seconds until a request could start on an executor (lower is better); `away_s`
    is added when the adapter is not resident and this is not its home executor."""
    seconds = work_tokens / rates.tokens_per_second
    if not is_resident:
        seconds += rates.load_seconds(adapter_bytes) + (0.0 if can_place else slot_wait_s) + away_s
    return seconds


def home(adapter: AdapterRef, addresses: list[str]) -> str:
    """The adapter's home executor by rendezvous hashing: stable as executors come and go."""
    return max(addresses, key=lambda a: hashlib.blake2b(f"{adapter}|{a}".encode(),
                                                        digest_size=8).digest())


@dataclass
class Popularity:
    """Exponentially decayed request counts per adapter (half-life in seconds): eviction keeps the
    adapters asked for most lately, which beats plain LRU on skewed (Zipf) traffic."""

    half_life_s: float = 60.0
    _counts: dict[AdapterRef, tuple[float, float]] = field(default_factory=dict)  # -> (count, at)

    def hit(self, adapter: AdapterRef, now: float) -> None:
        self._counts[adapter] = (self.value(adapter, now) + 1.0, now)

    def value(self, adapter: AdapterRef, now: float) -> float:
        count, at = self._counts.get(adapter, (0.0, now))
        return count * math.exp2(-(now - at) / self.half_life_s)
