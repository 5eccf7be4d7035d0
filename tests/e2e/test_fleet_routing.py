"""The scheduler drives two executor processes: pre-warm onto both, routing by residency, evict,
drain of one executor while requests keep completing on the other, its resume, and merging an
adapter into one executor under load."""

import asyncio
import random

import grpc
import pytest

from loraplex import client
from loraplex.launch import Fleet, FleetKeys
from protos import scheduler_pb2
from tests.oracle import hf_greedy

TENANT = "routing-test-tenant-key-0001"  # a tenant key of the fleet
KEYS = FleetKeys(tenants={TENANT: "t"})


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    store = tmp_path_factory.mktemp("store").as_uri()
    fleet = Fleet(model=tiny["model_dir"], store_url=store, log_dir=log_dir / "routing",
                  num_executors=2, executor_args=["--adapter-slots", "4", "--threads", "1"],
                  keys=KEYS)
    with fleet:
        yield fleet


@pytest.fixture(scope="module")
async def adapters(fleet, tiny):
    for name in ("r4_attn", "r8_mlp", "r16_all"):
        await client.push_adapter(fleet.stores[0], tiny["adapters"][name]["path"], name,
                                  key=KEYS.admin)


def admin():
    """Metadata presenting the fleet's admin key."""
    return client.metadata(KEYS.admin)


async def stats(stub) -> dict[str, scheduler_pb2.ExecutorStats]:
    response = await stub.Stats(scheduler_pb2.StatsRequest(), metadata=admin())
    return {ex.address: ex for ex in response.executors}


def holders(executors: dict, adapter: str) -> set[str]:
    def holds(ex) -> bool:
        return any(client.ref_text(s.adapter) == adapter and s.state == "ready" for s in ex.slots)

    return {a for a, ex in executors.items() if holds(ex)}


async def test_prewarm_onto_both_executors_pinned(fleet, adapters, stub):
    req = scheduler_pb2.PrewarmRequest(adapter="r4_attn", num_executors=2, pin=True, wait=True)
    resp = await stub.Prewarm(req, metadata=admin())
    assert client.ref_text(resp.adapter) == "r4_attn@1" and len(resp.executors) == 2
    executors = await stats(stub)
    assert holders(executors, "r4_attn@1") == set(executors)
    assert all(s.is_admin_pinned for ex in executors.values() for s in ex.slots
               if client.ref_text(s.adapter) == "r4_attn@1")


async def test_admin_rpcs_need_the_admin_key(fleet, adapters, stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Prewarm(scheduler_pb2.PrewarmRequest(adapter="r4_attn"))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Prewarm(scheduler_pb2.PrewarmRequest(adapter="r4_attn"),
                           metadata=client.metadata(TENANT))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Drain(scheduler_pb2.DrainRequest(executor="127.0.0.1:1"), metadata=admin())
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_requests_follow_residency(fleet, adapters, stub):
    req = scheduler_pb2.PrewarmRequest(adapter="r8_mlp", num_executors=1, wait=True)
    resp = await stub.Prewarm(req, metadata=admin())
    (home,) = resp.executors
    before = await stats(stub)
    for i in range(6):  # one at a time: the executor holding it is never busy enough to lose
        req = client.generate_request("r8_mlp", f"follow {i}", 4, ignore_eos=True)
        await client.generate(stub, req, TENANT)
    after = await stats(stub)
    assert holders(after, "r8_mlp@1") == {home}, "no second executor loaded it"
    assert sum(ex.adapter_loads for ex in after.values()) == \
        sum(ex.adapter_loads for ex in before.values())
    assert after[home].adapter_hits - before[home].adapter_hits == 6

    evicted = await stub.Evict(scheduler_pb2.EvictRequest(adapter="r8_mlp"), metadata=admin())
    assert evicted.num_evicted == 1 and not holders(await stats(stub), "r8_mlp@1")


async def test_drain_one_executor_while_requests_keep_completing(fleet, adapters, stub):
    req = scheduler_pb2.PrewarmRequest(adapter="r16_all", num_executors=2, wait=True)
    await stub.Prewarm(req, metadata=admin())
    calls = [asyncio.create_task(client.generate(stub, client.generate_request(
        "r16_all", f"long running {i}", 300, ignore_eos=True), TENANT)) for i in range(8)]
    for _ in range(200):
        executors = await stats(stub)
        if sum(ex.running for ex in executors.values()) == 8:
            break
        await asyncio.sleep(0.01)
    busy = max(executors.values(), key=lambda ex: ex.running)
    assert busy.running > 0, "work is running when the drain starts"
    with pytest.raises(grpc.aio.AioRpcError) as info:  # its adapter is pinned by running sequences
        await stub.Evict(scheduler_pb2.EvictRequest(adapter="r16_all", executor=busy.address),
                         metadata=admin())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await stub.Drain(scheduler_pb2.DrainRequest(executor=busy.address), metadata=admin())

    later = [asyncio.create_task(client.generate(stub, client.generate_request(
        "r16_all", f"after drain {i}", 8, ignore_eos=True), TENANT)) for i in range(6)]
    results = await asyncio.gather(*calls, *later)
    assert [len(r.token_ids) for r in results] == [300] * 8 + [8] * 6, "every request completed"
    executors = await stats(stub)
    drained = executors[busy.address]
    assert drained.is_draining and drained.is_drained and drained.running == 0
    steps = drained.steps
    await asyncio.gather(*(client.generate(stub, client.generate_request(
        "r16_all", f"still served {i}", 4, ignore_eos=True), TENANT) for i in range(4)))
    assert (await stats(stub))[busy.address].steps == steps, \
        "the drained executor admits nothing new"

    await stub.Resume(scheduler_pb2.ResumeRequest(executor=busy.address), metadata=admin())
    assert not (await stats(stub))[busy.address].is_draining
    await asyncio.gather(*(client.generate(stub, client.generate_request(
        "r16_all", f"resumed {i}", 200, ignore_eos=True), TENANT) for i in range(8)))
    assert (await stats(stub))[busy.address].steps > steps, "resumed, it admits work again"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Resume(scheduler_pb2.ResumeRequest(executor="127.0.0.1:1"), metadata=admin())
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_merge_and_unmerge_under_load_lose_nothing_and_keep_the_oracles_tokens(
        fleet, adapters, stub, hf_peft):
    """r16_all is merged into one executor while requests for it, r8_mlp and the base model
    stream, then unmerged: every request completes with HF PEFT's greedy tokens; merged, the
    executor runs only r16_all, and the other adapters are served by the other executor."""
    rng = random.Random(5)
    jobs = [(name, [rng.randrange(2, 1000) for _ in range(rng.randint(3, 12))])
            for name in ["r16_all"] * 12 + ["r8_mlp"] * 4 + [""] * 4]

    def launch(batch):
        return [asyncio.create_task(client.generate(stub, client.generate_request(
            name, prompt, 24, ignore_eos=True), TENANT)) for name, prompt in batch]

    def check(batch, results):
        for (name, prompt), got in zip(batch, results):
            assert got.token_ids == hf_greedy(hf_peft, prompt, 24, name or None)[0], name

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Merge(scheduler_pb2.MergeRequest(adapter="r16_all"),
                         metadata=client.metadata(TENANT))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Merge(scheduler_pb2.MergeRequest(adapter="r16_all", num_executors=2),
                         metadata=admin())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # one must serve everyone

    before = launch(jobs)
    await asyncio.sleep(0.2)
    merged = await stub.Merge(scheduler_pb2.MergeRequest(adapter="r16_all"), metadata=admin())
    (address,) = merged.executors
    for _ in range(600):
        executor = (await stats(stub))[address]
        if executor.is_merged:
            break
        await asyncio.sleep(0.05)
    assert executor.is_merged and client.ref_text(executor.dedicated_to) == "r16_all@1"
    during = launch(jobs)
    check(jobs, await asyncio.gather(*before))
    executors = await stats(stub)
    assert executors[address].is_merged, "still merged while its adapter's traffic runs"

    released = await stub.Unmerge(scheduler_pb2.UnmergeRequest(adapter="r16_all"),
                                  metadata=admin())
    assert list(released.executors) == [address]
    after = launch(jobs)
    check(jobs, await asyncio.gather(*during))
    check(jobs, await asyncio.gather(*after))
    executor = (await stats(stub))[address]
    assert not executor.is_merged and not client.ref_text(executor.dedicated_to)
