"""Waiting for an operator's pre-warm: a future of the executors where its loads failed."""

import asyncio

from common.adapter_ref import AdapterRef
from scheduler.executor_state import ExecutorState
from scheduler.residency.residency import Residency


def loads_done(residency: Residency, executors: list[ExecutorState],
               adapter: AdapterRef) -> asyncio.Future[list[str]]:
    """A future of the addresses among `executors` where `adapter` did not load, resolved (by the
    core's on_load_done, or the executor's loss) once none of them is loading it any more."""
    done: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
    pending, failed = len(executors), []

    def on_loaded(ex: ExecutorState, is_ready: bool) -> None:
        nonlocal pending
        pending -= 1
        if not is_ready:
            failed.append(ex.address)
        if not pending and not done.done():  # done: the waiting caller went away
            done.set_result(failed)

    for ex in executors:
        residency.of(ex).when_loaded(adapter, lambda is_ready, ex=ex: on_loaded(ex, is_ready))
    if not executors:
        done.set_result([])
    return done
