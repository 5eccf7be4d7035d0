"""A request's deadline at the gateway (its client's, or --request-timeout-s when the client sets
none): when it passes mid-stream the request ends DEADLINE_EXCEEDED saying how many tokens the
client got, and is cancelled at the scheduler; it never waits on."""

import time

import grpc

from common.server import insecure_channel
from loraplex import client
from loraplex.launch import Fleet, start_gateway
from protos import scheduler_pb2_grpc

STEP_S = 0.2  # the benchmark executor's step: a token every 0.2 s
TIMEOUT_S = 3.0  # ~15 tokens in: the first comes well before it even on a busy machine


async def test_a_request_past_its_deadline_ends_with_the_count_of_what_it_got(tmp_path):
    with Fleet(model="random:tiny", store_url=(tmp_path / "store").as_uri(),
               log_dir=tmp_path / "logs",
               executor_args=["--benchmark-step-s", str(STEP_S)]) as fleet:
        gateway = start_gateway({"tiny": [fleet.scheduler]}, fleet.stores, tmp_path / "logs",
                                args=["--request-timeout-s", str(TIMEOUT_S)])
        try:
            async with insecure_channel(gateway.address) as channel:
                request = client.generate_request("", [7, 8, 9], 100, ignore_eos=True)
                got, start = [], time.monotonic()
                try:  # no client deadline: the gateway's own applies
                    async for m in scheduler_pb2_grpc.SchedulerStub(channel).Generate(request):
                        got.append(m.token_id)
                    raise AssertionError(f"all {len(got)} tokens came within the deadline")
                except grpc.aio.AioRpcError as err:
                    error = err
                took = time.monotonic() - start
        finally:
            gateway.stop()
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error.details()
    assert f"deadline passed ({len(got)} tokens delivered)" in error.details()
    assert 0 < len(got) < 100
    assert TIMEOUT_S <= took < TIMEOUT_S + 10
