"""The gateway's one Stream to a cell's scheduler (scheduler.proto): every request the gateway
sends that cell travels on it, and its tokens come back as ids in batches, about one message per
executor step for all requests together, instead of a message per token per request.

Submits and cancels queue up and leave as one message per event-loop turn. Each request gets a
queue of its updates; the reader hands each update to its request's queue. The stream closes, and
every request on it gets the reason in its queue, when the scheduler ends it, when a write is not
taken within `write_s`, or when the cell is found down (a probe unanswered: dead or frozen), so
no request waits on a cell that stopped answering. A closed stream is replaced at the next
request (frontend.py).
"""

import asyncio
import dataclasses
import itertools
import logging

import grpc

from common.errors import LoraplexError, Unavailable, relayed
from gateway.pools import Cell
from protos import scheduler_pb2

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Update:
    """What one message of the stream brought one request."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    timing: tuple[float, float] | None = None  # (queue, first token) seconds, with its first token
    end: scheduler_pb2.StreamEnd | None = None  # how it ended (after these tokens), if it did


class CellStream:
    def __init__(self, cell: Cell, write_s: float):
        self.cell = cell
        self._write_s = write_s
        self._call = cell.stub.Stream(metadata=cell.auth)
        self._ids = itertools.count(1)
        self._open: dict[int, asyncio.Queue] = {}  # request id -> its updates
        self._submits: list[scheduler_pb2.StreamSubmit] = []
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self.error: LoraplexError | None = None  # why it closed; None while open
        self._tasks = [asyncio.create_task(coro) for coro in
                       (self._read(), self._write(), self._watch())]

    @property
    def is_open(self) -> bool:
        return self.error is None

    def submit(self, request: scheduler_pb2.GenerateRequest, tenant: str,
               timeout_s: float) -> tuple[int, asyncio.Queue]:
        """Send `request` (its id, and the queue its updates arrive in: Update, or the
        LoraplexError the stream closed with)."""
        stream_id = next(self._ids)
        updates: asyncio.Queue = asyncio.Queue()
        if self.error is not None:
            updates.put_nowait(self.error)
            return stream_id, updates
        self._open[stream_id] = updates
        self._submits.append(scheduler_pb2.StreamSubmit(
            id=stream_id, request=request, tenant=tenant, timeout_seconds=timeout_s))
        self._wake.set()
        return stream_id, updates

    def cancel(self, stream_id: int) -> None:
        """End an unfinished request (its client left, or a stop string matched here)."""
        if self._open.pop(stream_id, None) is not None and self.error is None:
            self._cancels.append(stream_id)
            self._wake.set()

    def close(self, error: LoraplexError) -> None:
        """End the stream: every request still on it gets `error`."""
        if self.error is not None:
            return
        self.error = error
        for updates in self._open.values():
            updates.put_nowait(error)
        self._open.clear()
        self._call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def _read(self) -> None:
        try:
            while (response := await self._call.read()) is not grpc.aio.EOF:
                self._deliver(response)
            self.close(Unavailable(f"scheduler {self.cell.address} ended its stream"))
        except grpc.aio.AioRpcError as err:
            self.close(relayed(err))

    def _deliver(self, response: scheduler_pb2.StreamResponse) -> None:
        """Hand each request its part of `response` (requests cancelled here meanwhile get
        nothing)."""
        updates: dict[int, Update] = {}
        for stream_id, token_id, logprob in zip(response.token_request_ids, response.token_ids,
                                                response.logprobs, strict=True):
            update = updates.get(stream_id)
            if update is None:
                update = updates[stream_id] = Update()
            update.token_ids.append(token_id)
            update.logprobs.append(logprob)
        for start in response.starts:
            updates.setdefault(start.id, Update()).timing = (
                start.queue_seconds, start.time_to_first_token_seconds)
        for end in response.ends:
            updates.setdefault(end.id, Update()).end = end
        for stream_id, update in updates.items():
            queue = self._open.get(stream_id)
            if queue is not None:
                queue.put_nowait(update)
                if update.end is not None:
                    del self._open[stream_id]

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                message = scheduler_pb2.StreamRequest(submits=self._submits,
                                                      cancels=self._cancels)
                self._submits, self._cancels = [], []
                async with asyncio.timeout(self._write_s):
                    await self._call.write(message)
        except TimeoutError:
            self.close(Unavailable(f"scheduler {self.cell.address} took no message within "
                                   f"{self._write_s:.0f}s"))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            self.close(Unavailable(f"the stream to scheduler {self.cell.address} broke: {err}"))

    async def _watch(self) -> None:
        await self.cell.lost.wait()
        log.warning("scheduler %s is down (%s): its stream closes", self.cell.address,
                    self.cell.problem)
        self.close(Unavailable(f"scheduler {self.cell.address} is down: {self.cell.problem}"))
