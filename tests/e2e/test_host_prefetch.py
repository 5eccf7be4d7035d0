"""Through the real services: a request whose adapter cannot get a GPU slot yet (the only slot is
pinned by a running sequence) has its adapter staged on the executor's host while it waits
(fetched, checked and parsed: stage before evict), so its load, once the slot frees, only copies.
And the scheduler's engine asks stores to warm adapters (while their loads back off) a few at a
time, each adapter once in a while."""

import asyncio

import pytest

from common.adapter_ref import AdapterRef
from common.server import insecure_channel
from loraplex import client
from loraplex.launch import Fleet
from protos import adapter_store_pb2 as pb
from protos import scheduler_pb2_grpc
from scheduler.engine import MAX_WARMS_IN_FLIGHT, Engine
from scheduler.fairness import FairnessWeights
from scheduler.limits import Limits


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    with Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("store").as_uri(),
               log_dir=log_dir / "host-prefetch",
               executor_args=["--adapter-slots", "1", "--max-rank", "32",
                              "--threads", "1"]) as fleet:
        yield fleet


async def test_warms_run_a_few_at_a_time_and_each_adapter_once():
    started, release = [], asyncio.Event()

    async def warm(adapter: AdapterRef) -> None:
        started.append(str(adapter))
        await release.wait()

    engine = Engine((), FairnessWeights(), Limits(), warm_host=warm)
    try:
        for i in range(10):
            engine._warm_host(AdapterRef.parse(f"a{i}@1"))
        engine._warm_host(AdapterRef.parse("a0@1"))
        await asyncio.sleep(0.05)
        assert started == [f"a{i}@1" for i in range(MAX_WARMS_IN_FLIGHT)]
        release.set()
        await asyncio.sleep(0.05)
        engine._warm_host(AdapterRef.parse("a0@1"))  # asked < WARM_AGAIN_S ago: not again
        engine._warm_host(AdapterRef.parse("a9@1"))  # skipped while others ran: warmed now
        await asyncio.sleep(0.05)
        assert started[MAX_WARMS_IN_FLIGHT:] == ["a9@1"]
    finally:
        await engine.stop()


async def store_stats(fleet) -> pb.StoreStatsResponse:
    return await client.store_call(fleet.stores[0], "Stats", pb.StoreStatsRequest())


async def test_waiting_adapter_is_staged_on_the_executor_and_its_load_fetches_nothing(fleet, tiny):
    for name in ("r8_mlp", "r16_all"):
        await client.push_adapter(fleet.stores[0], tiny["adapters"][name]["path"], name)
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        first_token = asyncio.Event()

        async def long_running() -> client.Generation:
            out = client.Generation()
            request = client.generate_request("r8_mlp", "hold the slot", 1000, ignore_eos=True)
            async for response in client.stream(stub, request):
                if response.HasField("token_id"):
                    out.token_ids.append(response.token_id)
                    first_token.set()
            return out

        holder = asyncio.create_task(long_running())
        await asyncio.wait_for(first_token.wait(), 60)
        before = await store_stats(fleet)
        assert (before.host_entries, before.fetches) == (1, 1)  # r8_mlp, loaded into the slot
        waiting = asyncio.create_task(client.generate(
            stub, client.generate_request("r16_all", "wait for the slot", 4, ignore_eos=True)))
        for _ in range(600):  # r16_all is staged on the executor (one fetch) while it waits
            during = await store_stats(fleet)
            if during.fetches == 2:
                break
            await asyncio.sleep(0.05)
        assert during.fetches == 2 and during.host_entries == 2, "staged while it waited"
        assert not holder.done(), "the slot was still pinned while the adapter was staged"
        assert len((await holder).token_ids) == 1000
        assert len((await waiting).token_ids) == 4
    after = await store_stats(fleet)
    assert after.fetches == 2, "its load copied the staged bytes: no fetch of its own"
    assert after.blob_reads == before.blob_reads + 1
