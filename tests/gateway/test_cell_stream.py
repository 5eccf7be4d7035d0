"""The gateway's Stream to a cell, against a scheduler on real gRPC (in this process) that sends
one token and then nothing more while its transport stays up: what a scheduler whose event loop
hangs looks like (gRPC's own threads still answer keepalive pings). Once the cell is found down,
the streaming request must end UNAVAILABLE within the stream's write bound, not at its deadline."""

import asyncio

import grpc

from common.errors import Unavailable
from gateway.cell_stream import Cell, CellStream, Update
from protos import scheduler_pb2, scheduler_pb2_grpc

WRITE_S = 1.0


class _Hangs(scheduler_pb2_grpc.SchedulerServicer):
    async def Stream(self, request_iterator, context):
        first = await anext(aiter(request_iterator))
        (submit,) = first.submits
        await context.write(scheduler_pb2.StreamResponse(
            token_request_ids=[submit.id], token_ids=[7], logprobs=[0.0],
            starts=[scheduler_pb2.StreamStart(id=submit.id)]))
        await asyncio.Event().wait()  # nothing more, ever


async def test_a_retired_stream_that_brings_nothing_ends_its_streaming_requests():
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(_Hangs(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    cell = Cell(f"127.0.0.1:{port}", channel, scheduler_pb2_grpc.SchedulerStub(channel))
    cell.up()
    stream = CellStream(cell, WRITE_S)
    try:
        _, updates = stream.submit(scheduler_pb2.GenerateRequest(), "tenant", 600.0)
        first = await asyncio.wait_for(updates.get(), 10)
        assert isinstance(first, Update) and first.token_ids == [7]
        cell.down("its probe went unanswered")  # (the pool's prober found it down)
        ended = await asyncio.wait_for(updates.get(), WRITE_S + 10)
        assert isinstance(ended, Unavailable) and "sent nothing" in str(ended)
        assert stream.error is not None
    finally:
        stream.close(Unavailable("test over"))
        await channel.close()
        await server.stop(None)
