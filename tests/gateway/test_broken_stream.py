"""A gateway's stream to a healthy scheduler that breaks with nothing delivered (what a gateway
frozen past the scheduler's keepalive finds when it wakes: the scheduler cut the connection it
left unanswered). The scheduler answers its probe at once, so the request that met the break, and
one routed right after it, are served, not refused as if the pool were down. Against schedulers
on real gRPC in this process: one that cuts its first Stream and serves the next, and one behind
a TCP proxy that cuts the connection of a gateway process while it is stopped (SIGSTOP)."""

import asyncio
import contextlib
import pathlib
import signal

import grpc

from common.credentials import KeyRing
from common.ratelimit import RateLimiter
from common.server import insecure_channel
from gateway.frontend import Frontend
from gateway.pools import Pools
from loraplex.launch import start_gateway
from protos import scheduler_pb2, scheduler_pb2_grpc

MODEL = "tiny"
TOKENS = [5, 6, 7]


class _CutsItsFirstStream(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, model: scheduler_pb2.ModelResponse, cuts: int = 1):
        self.model, self.cuts, self.streams, self.probes = model, cuts, 0, 0

    async def Model(self, request, context):
        self.probes += 1
        return self.model

    async def Stream(self, request_iterator, context):
        self.streams += 1
        if self.streams <= self.cuts:
            await anext(aiter(request_iterator))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        async for message in request_iterator:
            for submit in message.submits:
                await context.write(scheduler_pb2.StreamResponse(
                    token_request_ids=[submit.id] * len(TOKENS), token_ids=TOKENS,
                    logprobs=[0.0] * len(TOKENS), starts=[scheduler_pb2.StreamStart(id=submit.id)]))


def model_answer(tiny) -> scheduler_pb2.ModelResponse:
    tokenizer_json = (pathlib.Path(tiny["model_dir"]) / "tokenizer.json").read_text()
    return scheduler_pb2.ModelResponse(
        model_id=MODEL, max_model_len=256, vocab_size=1024, tokenizer_json=tokenizer_json,
        eos_token_ids=[1], fingerprint="f")


async def serve(scheduler: scheduler_pb2_grpc.SchedulerServicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def test_a_stream_cut_under_a_healthy_scheduler_costs_no_request(tiny):
    scheduler = _CutsItsFirstStream(model_answer(tiny))
    server, port = await serve(scheduler)
    pools = await Pools({MODEL: [f"127.0.0.1:{port}"]}, refresh_s=60.0, rpc_s=2.0).start()
    frontend = Frontend(pools, registry=None, limiter=RateLimiter({}), keys=KeyRing())
    try:
        route = await frontend.route(MODEL, "default")
        request = scheduler_pb2.GenerateRequest(
            token_ids=scheduler_pb2.TokenIds(ids=[3, 4]), max_new_tokens=len(TOKENS),
            ignore_eos=True)
        got = [m async for m in frontend.generate(route, request, "default")]
        assert [m.token_id for m in got if m.HasField("token_id")] == TOKENS
        assert scheduler.streams == 2 and scheduler.probes >= 2
        # A request routed while a break has the cell down waits for the probe it woke
        (cell,) = route.pool.cells.values()
        pools.cell_failed(cell, "the stream broke")
        probes = scheduler.probes
        assert (await asyncio.wait_for(frontend.route(MODEL, "default"), 10)).pool is route.pool
        assert cell.is_up and scheduler.probes > probes
    finally:
        await pools.close()
        await server.stop(None)


class _Proxy:
    """TCP from a listening port to `target`; `cut` closes every connection through it."""

    def __init__(self, target: int):
        self._target, self._pairs = target, []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _connect(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        self._pairs.append((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    @staticmethod
    async def _pipe(reader, writer) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        writer.close()

    def cut(self) -> None:
        for pair in self._pairs:
            for writer in pair:
                writer.transport.abort()
        self._pairs.clear()

    async def close(self) -> None:
        self.cut()
        self._server.close()


async def generate(address: str) -> list[int]:
    async with insecure_channel(address) as channel:
        request = scheduler_pb2.GenerateRequest(
            token_ids=scheduler_pb2.TokenIds(ids=[3, 4]), max_new_tokens=len(TOKENS),
            ignore_eos=True)
        return [m.token_id async for m in scheduler_pb2_grpc.SchedulerStub(channel).Generate(
                    request, timeout=60) if m.HasField("token_id")]


async def test_a_gateway_woken_after_its_connection_was_cut_serves_what_came_meanwhile(
        tiny, tmp_path):
    """The connection to the scheduler dies while the gateway is stopped; requests sent then
    are read once it runs again: the first calls on the dead connection fail at once (the
    probe's too), and the next, on a new connection, are served."""
    server, port = await serve(_CutsItsFirstStream(model_answer(tiny), cuts=0))
    proxy = _Proxy(port)
    gateway = await asyncio.to_thread(  # (the proxy runs on this loop meanwhile)
        start_gateway, {MODEL: [f"127.0.0.1:{await proxy.start()}"]}, ["127.0.0.1:9"], tmp_path,
        args=["--refresh-s", "0.5"])
    try:
        assert await generate(gateway.address) == TOKENS  # (its stream to the scheduler is open)
        gateway.process.send_signal(signal.SIGSTOP)
        proxy.cut()
        waiting = [asyncio.create_task(generate(gateway.address)) for _ in range(3)]
        await asyncio.sleep(1.5)  # (its refresh is due the moment it runs again)
        gateway.process.send_signal(signal.SIGCONT)
        assert await asyncio.wait_for(asyncio.gather(*waiting), 60) == [TOKENS] * 3
    finally:
        gateway.process.send_signal(signal.SIGCONT)
        gateway.stop()
        await proxy.close()
        await server.stop(None)
