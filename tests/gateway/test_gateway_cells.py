"""A pool of two cells (two schedulers, each with its own executor) behind the gateway: each
adapter stays in the one cell that ranks first for it, a frozen cell's requests complete on the
other with the tokens they would have had, and a cell that comes back gets its adapters again."""

import asyncio

import pytest

from common.server import insecure_channel
from gateway.pools import _weight
from loraplex import client
from loraplex.fixtures import MODEL_ID
from loraplex.launch import Fleet, start_gateway
from protos import scheduler_pb2, scheduler_pb2_grpc

ADAPTERS = ("r4_attn", "r8_mlp", "r16_all", "r2_q", "r12_vo", "r24_k_up")
EXECUTOR = ["--adapter-slots", str(len(ADAPTERS)), "--threads", "1"]


@pytest.fixture(scope="module")
def cells(tiny, tmp_path_factory, log_dir):
    logs = log_dir / "gateway-cells"
    first = Fleet(model=tiny["model_dir"], log_dir=logs / "a", executor_args=EXECUTOR,
                  store_url=tmp_path_factory.mktemp("cells-store").as_uri())
    second = gateway = None
    try:
        first.start()
        second = Fleet(model=tiny["model_dir"], store_url="", log_dir=logs / "b",
                       store_addresses=first.stores, executor_args=EXECUTOR).start()
        gateway = start_gateway({MODEL_ID: [first.scheduler, second.scheduler]}, first.stores,
                                logs, args=["--refresh-s", "0.5", "--rpc-s", "3"])
        yield first, second, gateway
    finally:
        for part in (gateway, second, first):
            if part is not None:
                part.stop()


async def generate(address: str, adapter: str, timeout: float = 90) -> str:
    async with insecure_channel(address) as channel:
        request = client.generate_request(adapter, "The little cat", 8)
        out = await asyncio.wait_for(client.generate(
            scheduler_pb2_grpc.SchedulerStub(channel), request), timeout)
    return out.text


async def loaded(fleet: Fleet) -> set[str]:
    """Adapters in the cell's slots."""
    async with insecure_channel(fleet.scheduler) as channel:
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).Stats(
            scheduler_pb2.StatsRequest())
    return {s.adapter.name for ex in stats.executors for s in ex.slots if s.adapter.name}


async def test_adapters_stick_to_one_cell_and_survive_a_frozen_one(cells, tiny):
    first, second, gateway = cells
    # Three names the gateway's hashing gives each cell (the cells listen on free ports: fixed
    # names could all go to one), each pushed with the weights of a fixture adapter.
    fixture_of = {f"{n}-{i}": n for i, n in enumerate(ADAPTERS * 4)}
    names = [name for cell, other in ((first, second), (second, first))
             for name in [n for n in fixture_of if _weight(n, cell.scheduler)
                          > _weight(n, other.scheduler)][:len(ADAPTERS) // 2]]
    for name in names:
        await client.push_adapter(first.stores[0], tiny["adapters"][fixture_of[name]]["path"],
                                  name)
    expected = {}
    for _ in range(3):
        for name in names:
            expected[name] = await generate(gateway.address, name)
    in_first, in_second = await loaded(first), await loaded(second)
    assert in_first | in_second == set(names) and not in_first & in_second
    assert in_first and in_second  # the names were chosen so that both get some

    up_line = f"scheduler {first.scheduler} of pool {MODEL_ID} is up"
    seen_up = gateway.log_path.read_text().count(up_line)
    first.by_name("scheduler")[0].freeze()
    try:
        answers = await asyncio.gather(*(generate(gateway.address, n) for n in names))
    finally:
        first.by_name("scheduler")[0].thaw()
    assert dict(zip(names, answers)) == expected
    assert set(names) <= await loaded(second)  # the frozen cell's adapters moved over

    for _ in range(120):  # the thawed cell answers the gateway's probe again
        if gateway.log_path.read_text().count(up_line) > seen_up:
            break
        await asyncio.sleep(0.25)
    else:
        pytest.fail("the gateway never saw the thawed cell up again")
    moved_back = sorted(in_first)[0]
    before = await requests_of(first)
    for _ in range(3):
        assert await generate(gateway.address, moved_back) == expected[moved_back]
    assert await requests_of(first) == before + 3


async def requests_of(fleet: Fleet) -> int:
    async with insecure_channel(fleet.scheduler) as channel:
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).Stats(
            scheduler_pb2.StatsRequest())
    return sum(t.requests for t in stats.tenants)
