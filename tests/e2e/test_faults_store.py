"""Outage drills on the adapter data path, with real processes and a SeaweedFS of the module's own:
the only store killed, and separately S3 frozen, while requests flow. Requests for resident
adapters keep completing, by name and by version (resolution is cached, the store is off their
path); requests for a cold adapter fail with a retryable status within their deadline (or
complete), never hang, and never cost a resident adapter its slot; after recovery everything
works again."""

import asyncio
import time

import grpc
import pytest

from common.server import insecure_channel
from loraplex import client
from loraplex.launch import Fleet, start_service
from protos import scheduler_pb2_grpc
from tests.s3server import seaweed_or_skip

HOT = ("r4_attn", "r8_mlp")  # resident in the executor's two slots
COLD = "r16_all"
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED}
DEADLINE_S = 6.0  # each request's own gRPC deadline
# Fast failure detection for the drill: registry lookups 1 s, loads and stagings 4 s, S3 calls
# 3 s (the store's own bounds).
SCHEDULER = ["--resolve-s", "1", "--load-floor-s", "4", "--load-backoff-s", "0.5",
             "--max-load-backoff-s", "2", "--step-warmup-s", "30"]


@pytest.fixture(scope="module")
def s3():
    """A SeaweedFS of this module's own, which a test freezes."""
    yield from seaweed_or_skip()


@pytest.fixture(scope="module")
def fleet(tiny, s3, log_dir):
    with Fleet(model=tiny["model_dir"], store_url=f"s3://{s3.bucket}/drill", num_stores=1,
               log_dir=log_dir / "faults-store",
               # No RAM tier: a fetch reads S3 each time, so only stage before evict keeps the
               # hot adapters (never fetched again) served while S3 is frozen.
               store_args=["--s3-endpoint-url", s3.endpoint_url, "--host-cache-mb", "0"],
               executor_args=["--adapter-slots", "2", "--threads", "1"],
               scheduler_args=SCHEDULER) as fleet:
        yield fleet


async def generate(stub, adapter: str, prompt: str, tokens: int = 6) -> client.Generation:
    request = client.generate_request(adapter, prompt, tokens, ignore_eos=True)
    out, start = client.Generation(), time.perf_counter()
    async for response in stub.Generate(request, timeout=DEADLINE_S):
        if response.HasField("token_id"):
            out.token_ids.append(response.token_id)
    out.total_seconds = time.perf_counter() - start
    return out


async def outcome(stub, adapter: str, prompt: str) -> tuple[str, float]:
    """("ok" or the status name, seconds); never longer than the deadline plus a margin."""
    start = time.perf_counter()
    try:
        got = await asyncio.wait_for(generate(stub, adapter, prompt), DEADLINE_S + 5)
        assert len(got.token_ids) == 6
        return "ok", time.perf_counter() - start
    except grpc.aio.AioRpcError as err:
        return err.code().name, time.perf_counter() - start


@pytest.fixture(scope="module")
async def expected(fleet, tiny):
    """Every adapter pushed; the fault-free tokens of each test request."""
    for name in (*HOT, COLD):
        await client.push_adapter(fleet.stores[0], tiny["adapters"][name]["path"], name)
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        tokens = {}
        for ref in (*HOT, *(f"{h}@1" for h in HOT), COLD):
            tokens[ref] = (await generate(stub, ref, "drill")).token_ids
        for hot in HOT:  # the two hot adapters last: they hold the two slots
            await generate(stub, hot, "drill")
    return tokens


async def serve_hot_adapters_and_a_cold_one(stub, expected) -> list[str]:
    """Hot requests by name and by version must complete with their tokens; the cold one may
    fail retryably within its deadline. Returns the cold outcomes."""
    cold = []
    for i in range(3):
        for ref in (*HOT, *(f"{h}@1" for h in HOT)):
            got = await asyncio.wait_for(generate(stub, ref, "drill"), DEADLINE_S + 5)
            assert got.token_ids == expected[ref], f"{ref} during the outage"
        status, seconds = await outcome(stub, COLD, f"cold {i}")
        assert status == "ok" or grpc.StatusCode[status] in RETRYABLE, status
        assert seconds < DEADLINE_S + 2, f"the cold request took {seconds:.1f}s"
        cold.append(status)
    return cold


async def test_the_only_store_killed_and_restarted(fleet, expected, log_dir):
    (store,) = fleet.by_name("adapter_store")
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        store.kill()
        try:
            cold = await serve_hot_adapters_and_a_cold_one(stub, expected)
            assert "ok" not in cold, "no store: the cold adapter cannot be fetched"
        finally:
            args = store.process.args[3:]  # python -m adapter_store.service ARGS
            revived = start_service("adapter_store-0", "adapter_store.service",
                                    [*args, "--address", store.address], log_dir / "faults-store")
            fleet.services[fleet.services.index(store)] = revived
        await recovered(stub, expected)


async def test_s3_frozen_and_thawed(fleet, expected, s3):
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        s3.freeze()
        try:
            await serve_hot_adapters_and_a_cold_one(stub, expected)
        finally:
            s3.thaw()
        await recovered(stub, expected)


async def recovered(stub, expected) -> None:
    """Within a minute of recovery the cold adapter is served, and then the hot ones again."""
    for _ in range(60):
        status, _ = await outcome(stub, COLD, "after")
        if status == "ok":
            break
        await asyncio.sleep(1)
    assert status == "ok"
    got = await generate(stub, COLD, "drill")
    assert got.token_ids == expected[COLD]
    for ref in (*HOT, *(f"{h}@1" for h in HOT)):
        assert (await generate(stub, ref, "drill")).token_ids == expected[ref]
