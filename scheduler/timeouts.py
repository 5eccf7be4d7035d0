"""How long the scheduler waits for what it asks of executors and stores: every wait is bounded,
and a part that stops answering is treated like one that died.

    step       max(step_floor_s, step_factor x the step's expected time), the expected time from
               the executor's measured token rate; step_warmup_s for the first steps after it
               connects (kernels compile on their first call on a GPU). A missed step deadline
               makes the executor suspect: the engine drops its stream and the core recomputes
               its sequences elsewhere (no token lost or repeated: tokens reach clients only
               from answered steps), and it gets work again only once Info and an empty probe
               step answer.
    probe      an idle executor is sent an empty step every probe_interval_s, answered within
               rpc_s, so a frozen idle executor is found before work is routed to it.
    merge      a step that merges or unmerges an adapter (merging.py) has merge_s more.
    load       max(load_floor_s, load_factor x bytes / the measured load bandwidth).
    rpc        Info, UnloadAdapter, probes: rpc_s.
    stream     a gateway's Stream that takes no message within stream_write_s ends, and its
               requests are cancelled (streams.py).
    registry   a lookup, per store replica: resolve_s; a host warm: warm_s. Names and aliases
               are asked again once resolve_ttl_s old (registry_client.py).
"""

import dataclasses

from scheduler.routing import Rates


@dataclasses.dataclass(frozen=True)
class Timeouts:
    rpc_s: float = 5.0
    step_floor_s: float = 10.0
    step_factor: float = 20.0
    step_warmup_s: float = 120.0
    warmup_steps: int = 8
    probe_interval_s: float = 2.0
    load_floor_s: float = 30.0
    load_factor: float = 10.0
    resolve_s: float = 2.0
    resolve_ttl_s: float = 1.0
    warm_s: float = 60.0
    merge_s: float = 120.0
    stream_write_s: float = 30.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"scheduler timeout {f.name} must be > 0, got "
                                 f"{getattr(self, f.name)}")

    def step(self, num_tokens: int, rates: Rates, steps_done: int) -> float:
        """Seconds an executor has to answer a step of `num_tokens` tokens."""
        if steps_done < self.warmup_steps:
            return self.step_warmup_s
        return max(self.step_floor_s, self.step_factor * num_tokens / rates.tokens_per_second)

    def load(self, num_bytes: int, rates: Rates) -> float:
        """Seconds an executor has to fetch and place an adapter of `num_bytes`."""
        return max(self.load_floor_s, self.load_factor * rates.load_seconds(num_bytes))
