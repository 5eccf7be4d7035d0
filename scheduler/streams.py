"""A gateway's Stream (scheduler.proto): many requests over one gRPC stream, their tokens sent in
batches.

A request's events land in its connection's outbox (the tokens sampled since the last message, as
columns, and the requests that started or ended); one writer sends all the outbox holds as one
message, then waits for more. Every event of an executor step comes in one turn of the event loop
(the engine's on_step_done), so a step's tokens leave as one message per connection, and a caller
that reads slowly gets fewer, larger messages. The scheduler does no detokenization here and applies
no stop strings: token ids only (the caller does both, and cancels a request whose stop string
matched).

Every wait is bounded: a message the caller does not take within `write_s` ends the stream. When
the stream ends, for any reason, its unfinished requests are cancelled: blocks, slot pins and
executor sequences are freed, as for a Generate whose client went away.
"""

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable, Sequence

from common import wire
from common.detokenizer import FINISH_PB, Finish
from common.errors import InvalidArgument, Unavailable, status_for
from protos import common_pb2, scheduler_pb2
from scheduler.core import Scheduler
from scheduler.metrics import SchedulerMetrics
from scheduler.request import ErrorEvent, Event, FinishEvent, Request, TokenSink


class _Outbox:
    """The next message: tokens as columns, and the requests that started or ended. It is its
    requests' TokenSink (request.py): the core adds their tokens as columns."""

    def __init__(self, ready: asyncio.Event) -> None:
        self._ready = ready  # (set when the outbox has something to send)
        self.stream_ids: list[int] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        # Each token's alternatives (ids, logprobs), None for none; empty while no token of the
        # message has any.
        self.tops: list[tuple[Sequence[int], Sequence[float]] | None] = []
        self.starts: list[scheduler_pb2.StreamStart] = []
        self.ends: list[scheduler_pb2.StreamEnd] = []

    def __bool__(self) -> bool:
        return bool(self.stream_ids or self.ends)

    def add(self, ids: Iterable[int], token_ids: Iterable[int],
            logprobs: Iterable[float]) -> None:
        if not self.stream_ids:
            self._ready.set()
        self.stream_ids.extend(ids)
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        if self.tops:
            self.tops.extend([None] * (len(self.token_ids) - len(self.tops)))

    def add_with_top(self, stream_id: int, token_id: int, logprob: float,
                     top_token_ids: Sequence[int], top_logprobs: Sequence[float]) -> None:
        self.add((stream_id,), (token_id,), (logprob,))
        if not self.tops:
            self.tops = [None] * len(self.token_ids)
        self.tops[-1] = (top_token_ids, top_logprobs)

    def drop(self, stream_id: int) -> None:
        """Forget the tokens of a request cancelled before they left."""
        if stream_id not in self.stream_ids:
            return
        kept = [i for i, r in enumerate(self.stream_ids) if r != stream_id]
        self.stream_ids = [self.stream_ids[i] for i in kept]
        self.token_ids = [self.token_ids[i] for i in kept]
        self.logprobs = [self.logprobs[i] for i in kept]
        if self.tops:
            self.tops = [self.tops[i] for i in kept]

    def end(self, stream_id: int, finish: Finish | None = None,
            error: BaseException | None = None) -> None:
        fields = {}
        if finish is not None:
            fields["finish_reason"] = FINISH_PB[finish]
        if error is not None:
            code, message = status_for(error)
            fields.update(error_code=code.value[0], error_message=message, retry_after=dict(
                getattr(error, "trailers", ())).get(wire.RETRY_AFTER, ""))
        self.ends.append(scheduler_pb2.StreamEnd(id=stream_id, **fields))

    def take(self) -> scheduler_pb2.StreamResponse:
        """The message, the outbox left empty."""
        message = scheduler_pb2.StreamResponse(
            token_request_ids=self.stream_ids, token_ids=self.token_ids, logprobs=self.logprobs,
            starts=self.starts, ends=self.ends)
        if self.tops:
            for top in self.tops:
                message.token_num_top.append(len(top[0]) if top else 0)
                if top:
                    message.top_token_ids.extend(top[0])
                    message.top_logprobs.extend(top[1])
            self.tops = []
        self.stream_ids, self.token_ids, self.logprobs, self.starts, self.ends = [], [], [], [], []
        return message


class StreamConnection:
    """One Stream's requests, by the caller's ids, and the outbox of their updates."""

    def __init__(self, core: Scheduler, metrics: SchedulerMetrics,
                 write: Callable[[scheduler_pb2.StreamResponse], Awaitable[None]], write_s: float):
        self._core, self._metrics = core, metrics
        self._write, self._write_s = write, write_s
        self._requests: dict[int, Request] = {}  # running or queued
        self._submitting: dict[int, asyncio.Task] = {}  # being checked (an adapter resolving)
        self._cancelled_early: set[int] = set()  # cancelled while being checked
        self._ready = asyncio.Event()
        self._outbox = _Outbox(self._ready)
        self._unstarted: set[int] = set()  # queued or running, no token sent yet

    # ---- the caller's messages --------------------------------------------------------------
    def submit(self, stream_id: int, check: Callable[[], Awaitable[Request]]) -> None:
        """Check a submitted request off the reading loop (`check` may wait on the registry:
        it makes the request, with `emitter(stream_id)` and `sink`, as `stream_id`), then queue
        it. A caller that reuses the id of an unfinished request is broken: its stream ends
        (INVALID_ARGUMENT)."""
        if stream_id in self._requests or stream_id in self._submitting:
            raise InvalidArgument(f"request id {stream_id} is already in use on this stream (ids "
                                  "are unique among unfinished requests): the stream ends")
        task = asyncio.create_task(self._admit(stream_id, check))
        self._submitting[stream_id] = task

    async def _admit(self, stream_id: int, check: Callable[[], Awaitable[Request]]) -> None:
        try:
            req = await check()
            if stream_id in self._cancelled_early:
                return
            self._requests[stream_id] = req
            self._unstarted.add(stream_id)
            self._core.submit(req)
        except Exception as exc:  # noqa: BLE001 - refused: the caller gets its status
            self._requests.pop(stream_id, None)
            self._unstarted.discard(stream_id)
            self._refuse(stream_id, exc)
        finally:
            del self._submitting[stream_id]
            self._cancelled_early.discard(stream_id)
            self._ready.set()  # (the writer may be waiting for the last request to end)

    def cancel(self, stream_id: int) -> None:
        if stream_id in self._submitting:
            self._cancelled_early.add(stream_id)
        req = self._requests.pop(stream_id, None)
        self._unstarted.discard(stream_id)
        if req is not None:
            self._core.cancel(req)
            self._outbox.drop(stream_id)  # (the id may come back, for a new request)
            self._metrics.on_finish(req, self._core.clock())

    def close(self) -> None:
        """The stream ended: cancel everything of it still unfinished."""
        for task in self._submitting.values():
            task.cancel()
        for stream_id in list(self._requests):
            self.cancel(stream_id)

    # ---- the requests' events ---------------------------------------------------------------
    @property
    def sink(self) -> TokenSink:
        """Where its requests' tokens go (each as its stream id's): the next message."""
        return self._outbox

    def emitter(self, stream_id: int) -> Callable[[Event], None]:
        """What a request of this stream emits its events to."""
        return functools.partial(self._on_event, stream_id)

    def _on_event(self, stream_id: int, event: Event) -> None:
        req = self._requests.pop(stream_id, None)
        if req is None:  # cancelled: its last events are not sent
            return
        self._ready.set()
        if stream_id in self._unstarted:
            self._unstarted.discard(stream_id)
            if req.first_token_at is not None:  # its first token is in the outbox
                self._start(stream_id, req)
        if isinstance(event, FinishEvent):
            self._outbox.end(stream_id, finish=event.reason)
        elif isinstance(event, ErrorEvent):
            self._outbox.end(stream_id, error=event.error)
        self._metrics.on_finish(req, self._core.clock())

    def _refuse(self, stream_id: int, error: BaseException) -> None:
        self._ready.set()
        self._outbox.end(stream_id, error=error)

    # ---- the writer -------------------------------------------------------------------------
    async def send(self, reading: asyncio.Task) -> None:
        """Write the outbox as it fills, until the caller's side has ended (`reading` done) and
        none of its requests is left. UNAVAILABLE when the caller takes no message within
        write_s; `reading`'s error when reading failed."""
        reading.add_done_callback(lambda _: self._ready.set())  # (its end wakes the writer too)
        while True:
            if reading.done() and reading.exception() is not None:
                raise reading.exception()
            if self._outbox:
                self._note_starts()
                message = self._outbox.take()
                try:
                    async with asyncio.timeout(self._write_s):
                        await self._write(message)
                except TimeoutError:
                    raise Unavailable(f"the caller took no message within {self._write_s:.0f}s: "
                                      "its stream ends and its requests are cancelled") from None
                continue
            if reading.done() and not self._requests and not self._submitting:
                return
            self._ready.clear()  # (nothing to do: wait for an event or for reading to end)
            await self._ready.wait()

    def _note_starts(self) -> None:
        """The outbox's requests with their first token in it get a StreamStart (found once
        per message, not per token)."""
        if not self._unstarted or not self._outbox.stream_ids:
            return
        started = self._unstarted.intersection(self._outbox.stream_ids)
        self._unstarted -= started
        for stream_id in sorted(started):
            self._start(stream_id, self._requests[stream_id])  # (an ended one left _unstarted)

    def _start(self, stream_id: int, req: Request) -> None:
        self._outbox.starts.append(started_pb(req, stream_id, req.prompt_logprobs))


def started_pb(req: Request, stream_id: int = 0,
               prompt_logprobs: common_pb2.TokenLogprobs | None = None
               ) -> scheduler_pb2.StreamStart:
    """How `req` started (a Stream's StreamStart for it, as `stream_id`; for a Generate, what
    its Usage says of it: common/generate_pb.py)."""
    return scheduler_pb2.StreamStart(
        id=stream_id, queue_seconds=(req.admitted_at or req.arrival) - req.arrival,
        time_to_first_token_seconds=(req.first_token_at or req.arrival) - req.arrival,
        prompt_logprobs=prompt_logprobs, cached_prompt_tokens=req.charges.cached_prompt_tokens,
        adapter_inactive=req.ask.adapter_inactive)


def check_no_stops(request: scheduler_pb2.GenerateRequest) -> None:
    if request.stop:
        raise InvalidArgument("Stream: stop strings are applied by the caller, which detokenizes; "
                              "send none (stop_token_ids are applied here)")

