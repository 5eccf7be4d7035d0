"""The ranks of a tensor-parallel executor as threads of the test's process: each rank a
ModelRunner of its own part, in a gloo group of its own (one HashStore), so a forward pass meets
in real collectives. `RankThreads` answers the calls tests/runner_driver.py makes of a runner:
each is made on every rank at once (their collectives need all of them), rank 0's answer given."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from executor.runner import ModelRunner
from executor.tp.collectives import TensorParallel

TIMEOUT = datetime.timedelta(seconds=60)


class RankThreads:
    """`world` ranks, runner r made by `make(TensorParallel of rank r)`."""

    _groups = 0  # each group its own prefix in its store

    def __init__(self, world: int, make: Callable[[TensorParallel], ModelRunner]) -> None:
        store = dist.PrefixStore(f"group-{RankThreads._groups}", dist.HashStore())
        RankThreads._groups += 1
        self._threads = ThreadPoolExecutor(world, thread_name_prefix="rank")

        def start(rank: int) -> ModelRunner:
            group = dist.ProcessGroupGloo(store, rank, world, TIMEOUT)  # (meets the others)
            return make(TensorParallel(rank, world, group))

        self.ranks = self._on_all([lambda _, r=r: start(r) for r in range(world)])

    def _on_all(self, calls: list[Callable[[Any], Any]], targets=None) -> list[Any]:
        targets = targets or [None] * len(calls)
        futures = [self._threads.submit(call, t) for call, t in zip(calls, targets)]
        return [f.result() for f in futures]

    def each(self, call: Callable[[ModelRunner], Any]) -> list[Any]:
        """`call(runner)` on every rank at once; every rank's answer."""
        return self._on_all([call] * len(self.ranks), self.ranks)

    def __getattr__(self, name: str) -> Any:
        """A runner method, called on every rank (rank 0's answer); any other attribute: rank
        0's."""
        first = getattr(self.ranks[0], name)
        if not callable(first):
            return first
        return lambda *args, **kw: self.each(lambda r: getattr(r, name)(*args, **kw))[0]

    def close(self) -> None:
        self._threads.shutdown()
