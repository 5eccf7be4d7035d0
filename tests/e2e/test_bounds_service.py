"""Bounded waits and leak-free cancels through the real services: a queued request's gRPC
deadline, a tenant's queue cap, an adapter no slot can ever take, and sequences cancelled while
their first step runs (the executor must forget them)."""

import asyncio
import contextlib

import grpc
import pytest

from common.server import insecure_channel
from loraplex import client
from loraplex.launch import Fleet
from protos import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

LONG = 1500  # tokens of a request that holds the executor's only running sequence


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    with Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("store").as_uri(),
               log_dir=log_dir / "bounds",
               executor_args=["--adapter-slots", "1", "--threads", "1"],
               scheduler_args=["--max-num-seqs", "1", "--max-queued-per-tenant", "2"]) as fleet:
        yield fleet


@pytest.fixture(scope="module")
async def stub(fleet, tiny):
    for name in ("r4_attn", "r8_mlp"):
        await client.push_adapter(fleet.stores[0], tiny["adapters"][name]["path"], name)
    async with insecure_channel(fleet.scheduler) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


async def status_of(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    return err.value


async def queued(stub) -> int:
    (ex,) = (await stub.Stats(scheduler_pb2.StatsRequest())).executors
    return ex.queued


@contextlib.asynccontextmanager
async def held(fleet, stub):
    """The executor's only running sequence held by a long request, the executor frozen from its
    first token on (SIGSTOP, for a few seconds: well inside its step deadline): however fast this
    machine, the request cannot end meanwhile, so requests behind it stay queued. Thawed, and
    the request cancelled, on exit."""
    first = asyncio.Event()

    async def run():
        async for response in client.stream(stub, client.generate_request(
                "", "hold", LONG, ignore_eos=True)):
            first.set()
    holder = asyncio.create_task(run())
    (executor,) = fleet.by_name("executor")
    try:
        await asyncio.wait_for(first.wait(), 60)
        executor.freeze()
        yield
    finally:
        executor.thaw()
        holder.cancel()


async def test_a_queued_request_is_dropped_at_its_deadline_and_frees_its_place(fleet, stub):
    async with held(fleet, stub):
        err = await status_of(stub.Generate(client.generate_request("", "waits", 4),
                                            timeout=1.0))
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(50):
            if await queued(stub) == 0:
                break
            await asyncio.sleep(0.05)
        assert await queued(stub) == 0


async def test_a_tenant_over_its_queue_cap_is_shed_with_retry_after(fleet, stub):
    async with held(fleet, stub):
        waiting = [asyncio.create_task(client.generate(stub, client.generate_request(
            "", f"q{i}", 2))) for i in range(2)]
        for _ in range(100):
            if await queued(stub) == 2:
                break
            await asyncio.sleep(0.05)
        err = await status_of(stub.Generate(client.generate_request("", "one too many", 2)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 requests waiting" in \
            err.details()
        assert float(dict(err.trailing_metadata())["retry-after"]) >= 1
    assert all(len(g.token_ids) == 2 for g in await asyncio.gather(*waiting))


async def test_a_pin_that_would_take_the_last_slot_is_refused(stub):
    """One adapter slot: a pin would leave none to other adapters (--unpinned-slots 1), so it
    is refused, and another adapter is still served after an unpinned pre-warm."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Prewarm(scheduler_pb2.PrewarmRequest(adapter="r4_attn", pin=True, wait=True))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "0 of its 1 adapter slots are pinned" in info.value.details()
    await stub.Prewarm(scheduler_pb2.PrewarmRequest(adapter="r4_attn", wait=True))
    got = await client.generate(stub, client.generate_request("r8_mlp", "room", 2))
    assert len(got.token_ids) == 2


async def test_sequences_cancelled_during_their_first_step_are_freed_on_the_executor(fleet,
                                                                                    stub):
    prompt = list(range(5, 1500))  # a long prefill: its first step takes a while
    for delay in (0.0, 0.01, 0.03, 0.06, 0.1, 0.2):
        call = stub.Generate(client.generate_request("", prompt, 50, ignore_eos=True))
        await asyncio.sleep(delay)
        call.cancel()
    await client.generate(stub, client.generate_request("", "after", 2))  # a step after them
    async with insecure_channel(fleet.by_name("executor")[0].address) as channel:
        executor = executor_pb2_grpc.ExecutorStub(channel)
        for _ in range(50):
            info = await executor.Info(executor_pb2.InfoRequest())
            if info.num_sequences == 0:
                break
            await asyncio.sleep(0.1)
    assert info.num_sequences == 0, "a cancelled sequence is still on the executor"
