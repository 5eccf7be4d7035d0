"""A Stream connection's messages, in process over the core (the World harness): every token in
the step's message, and each request's StreamStart in the message that carries its first token,
including a request whose first token is also its last."""

import asyncio

from common.detokenizer import OutputProcessor
from common.sampling import SamplingParams
from protos import scheduler_pb2
from scheduler.limits import Limits
from scheduler.metrics import SchedulerMetrics
from scheduler.request import Ask, Request
from scheduler.streams import StreamConnection
from tests.scheduler.sched_world import World


def _connection(w: World, sent: list) -> tuple[StreamConnection, asyncio.Task]:
    async def write(message: scheduler_pb2.StreamResponse) -> None:
        sent.append(message)

    connection = StreamConnection(w.core, SchedulerMetrics(w.core), write, write_s=10.0)
    reading = asyncio.get_running_loop().create_future()  # (the caller keeps its side open)
    return connection, asyncio.create_task(connection.send(reading))


def _submit(w: World, connection: StreamConnection, stream_id: int, max_new: int,
            tenant: str = "t") -> None:
    async def check() -> Request:
        req = Request(stream_id, Ask(tenant, None, 0, (1, 2, 3), SamplingParams()),
                      OutputProcessor(None, max_new_tokens=max_new),
                      connection.emitter(stream_id), sink=connection.sink, sink_id=stream_id)
        w.requests.append(req)
        return req
    connection.submit(stream_id, check)


async def test_each_start_comes_with_its_first_token():
    w = World(num_blocks=64, block_size=4)
    sent: list[scheduler_pb2.StreamResponse] = []
    connection, writer = _connection(w, sent)
    _submit(w, connection, 1, max_new=1)  # its only token ends it
    _submit(w, connection, 2, max_new=3)
    await asyncio.sleep(0)
    for _ in range(6):
        w.step()
        await asyncio.sleep(0)  # (the writer sends what the step produced)
        if len(sent) >= 3 and sent[-1].ends and sent[-1].ends[-1].id == 2:
            break
    writer.cancel()

    tokens = {1: [], 2: []}
    for message in sent:
        for stream_id in message.token_request_ids:
            tokens[stream_id].append(message)
    assert [len(tokens[1]), len(tokens[2])] == [1, 3]
    starts = [(i, start.id) for i, m in enumerate(sent) for start in m.starts]
    assert starts == [(0, 1), (0, 2)], "one start each, in the message of its first token"
    assert sent[0].ends[0].id == 1 and sent[0].ends[0].finish_reason == \
        scheduler_pb2.FINISH_REASON_LENGTH
    assert all(s.time_to_first_token_seconds >= 0 for m in sent for s in m.starts)


async def test_a_request_cancelled_before_its_first_token_gets_no_start():
    w = World()
    sent: list[scheduler_pb2.StreamResponse] = []
    connection, writer = _connection(w, sent)
    _submit(w, connection, 1, max_new=5)
    await asyncio.sleep(0)
    connection.cancel(1)
    for _ in range(3):
        w.step()
        await asyncio.sleep(0)
    writer.cancel()
    assert not any(m.starts or m.token_request_ids for m in sent)


async def test_an_id_cancelled_and_reused_before_the_message_left_gets_only_its_own_tokens():
    """The contract lets a caller reuse the id of a finished request: the cancelled one's token
    still in the outbox must not be credited to the new one (nor break the stream)."""
    w = World(num_blocks=64, block_size=4)
    sent: list[scheduler_pb2.StreamResponse] = []
    connection, writer = _connection(w, sent)
    _submit(w, connection, 1, max_new=5)
    await asyncio.sleep(0)
    w.step()  # its first token waits in the outbox (the writer has not run)
    connection.cancel(1)
    _submit(w, connection, 1, max_new=2)
    await asyncio.sleep(0)
    for _ in range(6):
        w.step()
        await asyncio.sleep(0)
        if sent and sent[-1].ends:
            break
    assert not writer.done(), writer.exception() if writer.done() else ""
    writer.cancel()
    assert sum(list(m.token_request_ids).count(1) for m in sent) == 2
    assert [s.id for m in sent for s in m.starts] == [1]
    assert [(e.id, e.finish_reason) for m in sent for e in m.ends] == [
        (1, scheduler_pb2.FINISH_REASON_LENGTH)]


async def test_a_refused_request_leaves_nothing_behind():
    w = World(limits=Limits(max_num_seqs=1, max_queued_per_tenant=2))
    sent: list[scheduler_pb2.StreamResponse] = []
    connection, writer = _connection(w, sent)
    for stream_id in range(1, 5):  # two wait (no step yet), two are over the queue cap
        _submit(w, connection, stream_id, max_new=50)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    writer.cancel()
    refused = [e.id for m in sent for e in m.ends]
    assert refused == [3, 4] and all(e.error_code for m in sent for e in m.ends)
    assert connection._unstarted == {1, 2}  # (only the requests it holds wait for a start)
