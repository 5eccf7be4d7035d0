"""A gateway's stream to a healthy scheduler that breaks with nothing delivered (what a gateway
frozen past the scheduler's keepalive finds when it wakes: the scheduler cut the connection it
left unanswered). The scheduler answers its probe at once, so the request that met the break, and
one routed right after it, are served, not refused as if the pool were down. Against a scheduler
on real gRPC in this process that cuts its first Stream and serves the next."""

import asyncio
import pathlib

import grpc

from common.credentials import KeyRing
from common.ratelimit import RateLimiter
from gateway.frontend import Frontend
from gateway.pools import Pools
from protos import scheduler_pb2, scheduler_pb2_grpc

MODEL = "tiny"
TOKENS = [5, 6, 7]


class _CutsItsFirstStream(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, model: scheduler_pb2.ModelResponse):
        self.model, self.streams, self.probes = model, 0, 0

    async def Model(self, request, context):
        self.probes += 1
        return self.model

    async def Stream(self, request_iterator, context):
        self.streams += 1
        if self.streams == 1:
            await anext(aiter(request_iterator))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        async for message in request_iterator:
            for submit in message.submits:
                await context.write(scheduler_pb2.StreamResponse(
                    token_request_ids=[submit.id] * len(TOKENS), token_ids=TOKENS,
                    logprobs=[0.0] * len(TOKENS), starts=[scheduler_pb2.StreamStart(id=submit.id)]))


async def test_a_stream_cut_under_a_healthy_scheduler_costs_no_request(tiny):
    tokenizer_json = (pathlib.Path(tiny["model_dir"]) / "tokenizer.json").read_text()
    scheduler = _CutsItsFirstStream(scheduler_pb2.ModelResponse(
        model_id=MODEL, max_model_len=256, vocab_size=1024, tokenizer_json=tokenizer_json,
        eos_token_ids=[1], fingerprint="f"))
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
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
