"""A client that stops reading cannot hold a server stream: a write it does not take within its
bound ends the call (common.errors.WriteBound, over real grpc.aio on loopback), the status
then waits behind what it has not read without holding the handler (grpc_errors bounds the
abort), and server-sent events end the same way (gateway.http_common.SSEResponse)."""

import asyncio
import time

import grpc
import pytest

from common import errors
from common.errors import WriteBound, grpc_errors
from gateway.http_common import SSEResponse
from protos import scheduler_pb2, scheduler_pb2_grpc

WRITE_S = 1.0
BIG = "x" * 4096  # (messages that fill the flow-control window quickly)


async def test_a_grpc_client_that_stops_reading_ends_its_call_and_frees_the_handler(monkeypatch):
    monkeypatch.setattr(errors, "ABORT_S", 1.0)
    ended = asyncio.get_running_loop().create_future()

    class Servicer(scheduler_pb2_grpc.SchedulerServicer):
        async def Generate(self, request, context):
            written = 0
            try:
                with WriteBound(WRITE_S) as bound:
                    async with grpc_errors(context):
                        while True:
                            await bound.write(context, scheduler_pb2.GenerateResponse(
                                token_id=written, text=BIG))
                            written += 1
            finally:
                ended.set_result(written)

    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = scheduler_pb2_grpc.SchedulerStub(channel).Generate(
                scheduler_pb2.GenerateRequest())
            await call.read()  # one message, then the client reads no more
            start = time.monotonic()
            written = await asyncio.wait_for(ended, 30)
            assert written > 1 and time.monotonic() - start < WRITE_S + 1.0 + 10
            with pytest.raises(grpc.aio.AioRpcError) as err:  # what it had not read, then why
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "took no message within" in err.value.details()
    finally:
        await server.stop(None)


async def test_server_sent_events_to_a_client_that_stops_reading_end_and_close_their_source():
    closed = asyncio.Event()

    async def events():
        try:
            while True:
                yield "data: token\n\n"
        finally:
            closed.set()  # (where the gateway cancels the request at its pool)

    sent = []

    async def send(message) -> None:
        sent.append(message)
        if len(sent) > 2:  # the headers and one event, then the client reads no more
            await asyncio.Event().wait()

    async def receive():
        await asyncio.Event().wait()  # (it never disconnects either)

    response = SSEResponse(events(), write_s=WRITE_S)
    await asyncio.wait_for(response({"type": "http"}, receive, send), WRITE_S + 10)
    assert closed.is_set()


async def test_a_grpc_client_that_reads_slowly_is_not_cut_by_time_between_writes():
    """Gaps longer than the bound between writes, each write taken at once: the call lives on
    (only a write the client does not take counts)."""
    class Servicer(scheduler_pb2_grpc.SchedulerServicer):
        async def Generate(self, request, context):
            with WriteBound(0.2) as bound:
                async with grpc_errors(context):
                    for i in range(5):
                        await bound.write(context, scheduler_pb2.GenerateResponse(token_id=i))
                        await asyncio.sleep(0.3)

    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = scheduler_pb2_grpc.SchedulerStub(channel).Generate(
                scheduler_pb2.GenerateRequest())
            assert [m.token_id async for m in call] == list(range(5))
    finally:
        await server.stop(None)
