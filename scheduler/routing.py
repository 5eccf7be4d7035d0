"""Where a request should run: the executor with the least expected time until it can start.

    score(ex) = queued and running work on ex / ex's token rate      (seconds of work ahead)
              + time to bring the adapter in, if ex does not hold it  (bytes / load bandwidth)
              + slot_wait_s, if every slot of ex is pinned            (it must wait for one)

Both rates are measured (exponential moving averages of step and load timings), so a busy
executor holding the adapter loses to an idle one once its backlog outweighs a load: that is how
a hot adapter gets replicated as its traffic grows, and a cold one lands where a load is cheapest.
"""

from dataclasses import dataclass

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
          slot_wait_s: float) -> float:
    """Expected seconds until a request could start on an executor (lower is better)."""
    seconds = work_tokens / rates.tokens_per_second
    if not is_resident:
        seconds += rates.load_seconds(adapter_bytes) + (0.0 if can_place else slot_wait_s)
    return seconds
