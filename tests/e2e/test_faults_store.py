"""Outage drills on the adapter data path, with real processes and a SeaweedFS of the module's own:
the only store killed, and separately S3 frozen, while requests flow. Requests for resident
adapters keep completing, by name and by version (resolution is cached, the store is off their
path); requests for a cold adapter fail with a retryable status within their deadline (or
complete), never hang, and never cost a resident adapter its slot; after recovery everything
works again. The load-wait drill: with S3 frozen, resident and cold requests at once; every cold
one ends UNAVAILABLE with a retry-after within the scheduler's --max-load-wait-s, well before its
own deadline."""

import asyncio
import time

import grpc
import pytest

from common import wire
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
MAX_LOAD_WAIT_S = 3.0  # the scheduler's bound on a request's wait for its adapter's fetch
# Fast failure detection for the drill: registry lookups 1 s, loads and stagings 4 s, S3 calls
# 3 s (the store's own bounds), a wait for a fetch 3 s.
SCHEDULER = ["--resolve-s", "1", "--load-floor-s", "4", "--load-backoff-s", "0.5",
             "--max-load-backoff-s", "2", "--step-warmup-s", "30",
             "--max-load-wait-s", str(MAX_LOAD_WAIT_S)]


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


DRILL_DEADLINE_S = 20.0  # far past the load bound: the bound, not the deadline, must end a wait
BOUND_SLACK_S = 2.0  # the scheduler's 0.1 s tick, the resolution and a loaded 2-core machine


async def timed(stub, adapter: str) -> tuple[str, list[int], str, float]:
    """(status name or "OK", tokens, retry-after trailer, seconds from the call to its end)."""
    request = client.generate_request(adapter, "drill", 6, ignore_eos=True)
    tokens, start = [], time.perf_counter()
    call = stub.Generate(request, timeout=DRILL_DEADLINE_S)
    try:
        async for response in call:
            if response.HasField("token_id"):
                tokens.append(response.token_id)
    except grpc.aio.AioRpcError as err:
        retry = dict(err.trailing_metadata() or ()).get(wire.RETRY_AFTER, "")
        return err.code().name, tokens, retry, time.perf_counter() - start
    return "OK", tokens, "", time.perf_counter() - start


async def test_s3_frozen_cold_requests_end_within_the_load_bound(fleet, expected, s3, tiny):
    cold = [f"drill-cold-{i}" for i in range(3)]  # never fetched: only S3 has their bytes
    for name in cold:
        await client.push_adapter(fleet.stores[0], tiny["adapters"][COLD]["path"], name)
    hot_refs = [*HOT, *(f"{h}@1" for h in HOT)] * 3
    cold_refs = [f"{name}@1" for name in cold for _ in range(2)]
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for hot in HOT:  # resident in the two slots
            await generate(stub, hot, "drill")
        s3.freeze()
        try:
            results = await asyncio.gather(*(timed(stub, ref) for ref in hot_refs + cold_refs))
        finally:
            s3.thaw()
    for ref, (status, tokens, _, seconds) in zip(hot_refs, results):
        assert (status, tokens) == ("OK", expected[ref]), f"{ref} after {seconds:.1f}s"
    bound = MAX_LOAD_WAIT_S + BOUND_SLACK_S
    for ref, (status, _, retry, seconds) in zip(cold_refs, results[len(hot_refs):]):
        assert status == "UNAVAILABLE" and float(retry) > 0, (ref, status, retry, seconds)
        assert seconds < bound, f"{ref} ended after {seconds:.1f}s, past the {bound:.0f}s bound"
