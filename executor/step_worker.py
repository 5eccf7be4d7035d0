"""The executor's step thread: one Step stream's steps run in order on one thread, each starting
as soon as the step before it ends if its request is already here (the scheduler pipelines its
steps: it sends the next before this one's answer). No hop through the event loop between two
steps: the loop only reads requests in and writes answers out, beside the thread.

    worker = StepWorker(run_step, loop)
    worker.submit(request)      # from the event loop, as requests arrive
    await worker.result()       # answers in order; a step's exception is raised here, and no
                                # later step runs
    worker.finish()             # no more requests: result() gives None after the last answer
    worker.stop()               # the stream is gone: steps not started are dropped
    await worker.done           # the thread has ended (its last step too)
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

_END = object()


class StepWorker:
    def __init__(self, run_step: Callable[[Any], Any], loop: asyncio.AbstractEventLoop) -> None:
        self._run, self._loop = run_step, loop
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._results: asyncio.Queue = asyncio.Queue()
        self._stopped = False
        self._unanswered = 0  # requests submitted whose answers result() has not given yet
        self.done: asyncio.Future = loop.create_future()
        threading.Thread(target=self._work, name="executor-steps", daemon=True).start()

    @property
    def is_idle(self) -> bool:
        """Every request submitted has been answered: the client owes the next message."""
        return not self._unanswered

    def submit(self, request: Any) -> None:
        self._unanswered += 1
        self._requests.put(request)

    def finish(self) -> None:
        self._requests.put(_END)

    def stop(self) -> None:
        self._stopped = True
        self._requests.put(_END)

    async def result(self) -> Any:
        """The next answer, None once the requests ended and all were answered."""
        is_ok, value = await self._results.get()
        if not is_ok:
            raise value
        if value is not None:
            self._unanswered -= 1
        return value

    def _work(self) -> None:
        try:
            while (request := self._requests.get()) is not _END and not self._stopped:
                try:
                    out = (True, self._run(request))
                except Exception as err:  # the stream ends with it; nothing after it runs
                    self._post((False, err))
                    return
                self._post(out)
            self._post((True, None))
        finally:
            self._call(lambda: self.done.done() or self.done.set_result(None))

    def _post(self, item: tuple[bool, Any]) -> None:
        self._call(lambda: self._results.put_nowait(item))

    def _call(self, fn: Callable[[], Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass
