"""Adapters staged on the executor's host: fetched from a store, checked and parsed into a
staging buffer, waiting for a slot (the StageAdapter RPC; see executor.proto).

The scheduler stages an adapter before it gives up another adapter's slot for it, so the slow and
fallible part of a load (the store, S3) happens while the old adapter still serves; the load then
only copies. Staged adapters are bounded: by bytes (the oldest go first when a new one needs
room) and by age (one no load took within `ttl_s` is dropped); a dropped one is fetched again by
the load that wants it.
"""

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from common.adapter_ref import AdapterRef
from executor.lora.slot_pool import LoraWeights


@dataclasses.dataclass
class Staged:
    buffer: torch.Tensor  # the staging buffer holding the bytes (views of it in `weights`)
    num_bytes: int
    weights: LoraWeights
    seconds: float  # how long the fetch, check and parse took
    at: float  # monotonic time it was staged


class StagedAdapters:
    def __init__(self, release: Callable[[torch.Tensor], None], max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._release = release  # hands a buffer back to the staging pool
        self._max_bytes, self._ttl_s, self._clock = max_bytes, ttl_s, clock
        self._entries: OrderedDict[AdapterRef, Staged] = OrderedDict()  # oldest first

    def __contains__(self, adapter: AdapterRef) -> bool:
        self._expire()
        return adapter in self._entries

    @property
    def num_bytes(self) -> int:
        """Host memory held: the staging buffers (a reused one may be larger than its adapter)."""
        return sum(s.buffer.numel() for s in self._entries.values())

    def put(self, adapter: AdapterRef, staged: Staged) -> None:
        """Keep `staged` (replacing an older staging of the same adapter), within the budget."""
        self._expire()
        if adapter in self._entries:
            self._drop(adapter)
        while self._entries and self.num_bytes + staged.buffer.numel() > self._max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[adapter] = staged

    def take(self, adapter: AdapterRef) -> Staged | None:
        """The staged adapter, no longer kept here (the caller releases its buffer)."""
        self._expire()
        return self._entries.pop(adapter, None)

    def _expire(self) -> None:
        now = self._clock()
        for adapter in [a for a, s in self._entries.items() if now - s.at > self._ttl_s]:
            self._drop(adapter)

    def _drop(self, adapter: AdapterRef) -> None:
        self._release(self._entries.pop(adapter).buffer)
