"""A pool's cell (one scheduler: its channel, whether it is up) and the gateway's Stream to it
(scheduler.proto). Pools (pools.py) make cells and find them up or down; the frontend sends
requests on their streams.

Every request the gateway sends a cell travels on its stream, and its tokens come back as ids in
batches, about one message per executor step for all requests together, instead of a message per
token per request.

Submits and cancels queue up and leave together at the next write (at most MAX_WRITE_BYTES of
submits per message). Each request gets a queue of its updates; the reader hands each its part of
every message.

When the cell is found down (a probe unanswered: stopping, dead or frozen), its requests that have
had no token yet get UNAVAILABLE at once (the frontend sends them to another cell) and the stream
retires: it takes no new request, serves those that are streaming, and closes once they end. A
frozen scheduler cannot hold them: the channel's keepalive breaks the call within 15 s, and a
retired stream that brings nothing for `write_s` closes (a scheduler whose event loop hangs still
answers pings: gRPC's own threads do). The
stream closes, every request on it getting the reason, when the scheduler ends it or the call
breaks, or when a write is not taken within `write_s`. A closed or retired stream is replaced at
the cell's next request (frontend.py).
"""

import asyncio
import dataclasses
import itertools
import logging
import time

import grpc

from common.errors import LoraplexError, Unavailable, relayed, relayed_status
from protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

MAX_WRITE_BYTES = 4 << 20  # submits per message (long prompts queued together stay well below
# the channel's message limit)
_LIVE: set["CellStream"] = set()  # (asyncio holds tasks weakly: a retired stream is kept here)


@dataclasses.dataclass(eq=False)
class Cell:
    """One scheduler of a pool."""

    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    # The service key as call metadata: passed per call rather than by a channel interceptor,
    # which would cost a Python task per call and a wrapper around every streamed message.
    auth: tuple[tuple[str, str], ...] = ()
    is_up: bool = False
    problem: str = "not asked yet"  # why it is down
    # Found down by a call (its stream broke), not by a probe, and no probe has answered since:
    # a stream breaks also when the scheduler is fine (it cut one that this gateway, frozen,
    # left unanswered), so requests wait for that probe before they are refused (pools.py)
    unprobed: bool = False
    # Set while down: requests still waiting for its first answer move to another cell.
    lost: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    stream: "CellStream | None" = None  # the gateway's requests to it

    def up(self) -> None:
        self.is_up, self.problem, self.unprobed = True, "", False
        self.lost.clear()

    def down(self, problem: str, by_call: bool = False) -> None:
        self.is_up, self.problem, self.unprobed = False, problem, by_call
        self.lost.set()

    def close_stream(self) -> None:
        if self.stream is not None:
            self.stream.close(Unavailable(f"scheduler {self.address} left the pool"))


@dataclasses.dataclass
class Update:
    """What one message of the stream brought one request."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # Each token's alternatives (ids, logprobs), when its request asks for them; else empty.
    tops: list[tuple[list[int], list[float]]] = dataclasses.field(default_factory=list)
    # With its first token: how it started (queue and first-token seconds, cached prompt tokens,
    # an activated LoRA that did not activate)
    start: scheduler_pb2.StreamStart | None = None
    # The prompt's logprobs, with its first token, when its request asks for them.
    prompt_logprobs: common_pb2.TokenLogprobs | None = None
    end: scheduler_pb2.StreamEnd | None = None  # how it ended (after these tokens), if it did


class CellStream:
    def __init__(self, cell: Cell, write_s: float):
        self.cell = cell
        self._write_s = write_s
        self._call = cell.stub.Stream(metadata=cell.auth)
        self._ids = itertools.count(1)
        self._open: dict[int, asyncio.Queue] = {}  # request id -> its updates
        self._streaming: set[int] = set()  # open requests that have had a token
        self._submits: dict[int, scheduler_pb2.StreamSubmit] = {}  # not written yet
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self._read_at = time.monotonic()  # when the last message came
        self.is_retired = False  # takes no new request (its cell was found down)
        self.error: LoraplexError | None = None  # why it closed; None while open
        self._tasks = [asyncio.create_task(coro) for coro in
                       (self._read(), self._write(), self._watch())]
        _LIVE.add(self)

    @property
    def takes_requests(self) -> bool:
        return self.error is None and not self.is_retired

    def submit(self, request: scheduler_pb2.GenerateRequest, tenant: str,
               timeout_s: float) -> tuple[int, asyncio.Queue]:
        """Send `request` (its id, and the queue its updates arrive in: Update, or the
        LoraplexError the stream ended it with)."""
        stream_id = next(self._ids)
        updates: asyncio.Queue = asyncio.Queue()
        if not self.takes_requests:
            updates.put_nowait(self.error or Unavailable(f"scheduler {self.cell.address} is "
                                                         "down"))
            return stream_id, updates
        self._open[stream_id] = updates
        self._submits[stream_id] = scheduler_pb2.StreamSubmit(
            id=stream_id, request=request, tenant=tenant, timeout_seconds=timeout_s)
        self._wake.set()
        return stream_id, updates

    def cancel(self, stream_id: int) -> None:
        """End an unfinished request (its client left, or a stop string matched here)."""
        if self._open.pop(stream_id, None) is None or self.error is not None:
            return
        self._streaming.discard(stream_id)
        if self._submits.pop(stream_id, None) is None:  # (one not written yet is just dropped)
            self._cancels.append(stream_id)
            self._wake.set()
        self._close_if_retired_and_done()

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
        _LIVE.discard(self)

    def _close_if_retired_and_done(self) -> None:
        if self.is_retired and not self._open:
            self.close(Unavailable(f"scheduler {self.cell.address} is down"))

    async def _read(self) -> None:
        try:
            while (response := await self._call.read()) is not grpc.aio.EOF:
                self._read_at = time.monotonic()
                self._deliver(response)
            self.close(Unavailable(f"scheduler {self.cell.address} ended its stream"))
        except grpc.aio.AioRpcError as err:
            self.close(relayed(err))
        except Exception as err:  # noqa: BLE001 - a bug, or a malformed answer: never a hang
            log.exception("the stream from scheduler %s failed", self.cell.address)
            self.close(Unavailable(f"the stream from scheduler {self.cell.address} failed: "
                                   f"{err!r}"))

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
        if response.token_num_top:
            _deliver_tops(response, updates)
        for start in response.starts:
            update = updates.setdefault(start.id, Update())
            update.start = start
            if start.HasField("prompt_logprobs"):
                update.prompt_logprobs = start.prompt_logprobs
        for end in response.ends:
            updates.setdefault(end.id, Update()).end = end
        for stream_id, update in updates.items():
            queue = self._open.get(stream_id)
            if queue is None:
                continue
            queue.put_nowait(update)
            if update.token_ids:
                self._streaming.add(stream_id)
            if update.end is not None:
                del self._open[stream_id]
                self._streaming.discard(stream_id)
        self._close_if_retired_and_done()

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await self._write_some()
        except TimeoutError:
            self.close(Unavailable(f"scheduler {self.cell.address} took no message within "
                                   f"{self._write_s:.0f}s"))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            self.close(await self._ended_with(err))

    async def _write_some(self) -> None:
        """One message: the cancels, and the submits that fit MAX_WRITE_BYTES (at least one;
        the rest wait for the next)."""
        message = scheduler_pb2.StreamRequest(cancels=self._cancels)
        self._cancels, size = [], 0
        while self._submits and (size < MAX_WRITE_BYTES or not message.submits):
            stream_id = next(iter(self._submits))
            submit = self._submits.pop(stream_id)
            size += submit.ByteSize()
            message.submits.append(submit)
        if self._submits:
            self._wake.set()
        async with asyncio.timeout(self._write_s):
            await self._call.write(message)

    async def _ended_with(self, err: Exception) -> LoraplexError:
        """Why a call that refused a write ended: its status, as the scheduler sent it."""
        try:
            async with asyncio.timeout(self._write_s):
                code, details = await self._call.code(), await self._call.details()
        except TimeoutError:
            return Unavailable(f"the stream to scheduler {self.cell.address} broke: {err!r}")
        return relayed_status(code.value[0], details)

    async def _watch(self) -> None:
        await self.cell.lost.wait()
        log.warning("scheduler %s is down (%s): its requests without a token move on, its "
                    "stream retires", self.cell.address, self.cell.problem)
        self.is_retired = True
        down = Unavailable(f"scheduler {self.cell.address} is down: {self.cell.problem}")
        for stream_id in [i for i in self._open if i not in self._streaming]:
            self._open[stream_id].put_nowait(down)
            self.cancel(stream_id)  # (a scheduler that comes back frees it)
        self._close_if_retired_and_done()
        while self.error is None:  # (streaming ones stay while their tokens come)
            silent_s = time.monotonic() - self._read_at
            if silent_s >= self._write_s:
                self.close(Unavailable(f"scheduler {self.cell.address} is down and sent nothing "
                                       f"for {self._write_s:.0f}s"))
                return
            await asyncio.sleep(self._write_s - silent_s)


def _deliver_tops(response: scheduler_pb2.StreamResponse, updates: dict[int, Update]) -> None:
    """Each token's alternatives to its request's update (the updates hold the message's tokens
    in its order)."""
    counts = response.token_num_top
    if not len(counts) == len(response.token_ids) or not sum(counts) == len(
            response.top_token_ids) == len(response.top_logprobs):
        raise ValueError(f"a stream message's alternatives do not add up: {len(counts)} counts "
                         f"(sum {sum(counts)}) for {len(response.token_ids)} tokens, "
                         f"{len(response.top_token_ids)} ids, {len(response.top_logprobs)} "
                         "logprobs")
    at = 0
    for stream_id, n in zip(response.token_request_ids, counts):
        updates[stream_id].tops.append((response.top_token_ids[at:at + n],
                                        response.top_logprobs[at:at + n]))
        at += n
