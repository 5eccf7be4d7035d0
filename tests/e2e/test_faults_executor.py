"""Outage drills on executors, with real processes: an executor frozen mid-generation (SIGSTOP,
like a hung process or GPU) is treated like a dead one once it misses a step deadline: every
stream completes on the other executor with exactly the tokens of a fault-free run (seeded
sampled ones too), and the frozen one, resumed, rejoins and gets work. Seeded sampling gives the
same tokens across KV preemption too."""

import asyncio

import pytest

from common.server import insecure_channel
from loraplex import client
from loraplex.launch import Fleet
from protos import scheduler_pb2, scheduler_pb2_grpc

# Short deadlines so a drill takes seconds: a step is overdue after 2 s (the first steps of a
# connection after 4 s), an idle executor is probed every 0.5 s.
FAST_FAILOVER = ["--step-floor-s", "2", "--step-warmup-s", "4", "--warmup-steps", "2",
                 "--probe-interval-s", "0.5", "--rpc-s", "2"]
ADAPTERS = ("r4_attn", "r8_mlp", "r16_all", "")
NUM_TOKENS = 40


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    with Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("store").as_uri(),
               log_dir=log_dir / "faults-executor", num_executors=2,
               executor_args=["--adapter-slots", "4", "--threads", "1"],
               scheduler_args=FAST_FAILOVER) as fleet:
        yield fleet


@pytest.fixture(scope="module")
async def pushed(fleet, tiny):
    for name in ADAPTERS[:-1]:
        await client.push_adapter(fleet.stores[0], tiny["adapters"][name]["path"], name)


def requests() -> list[scheduler_pb2.GenerateRequest]:
    """Greedy and seeded sampled requests across three adapters and the base model."""
    out = []
    for i in range(16):
        sampled = dict(temperature=0.9, seed=1000 + i) if i % 2 else {}
        out.append(client.generate_request(ADAPTERS[i % len(ADAPTERS)], f"drill prompt {i}",
                                           NUM_TOKENS, ignore_eos=True, **sampled))
    return out


async def executor_stats(stub) -> dict[str, scheduler_pb2.ExecutorStats]:
    return {ex.address: ex for ex in (await stub.Stats(scheduler_pb2.StatsRequest())).executors}


async def with_the_busiest_frozen(fleet, stub, calls: list[asyncio.Task]) -> tuple[list, str]:
    """The results of `calls` (within 120 s), with the executor running the most sequences
    frozen (SIGSTOP) until they end; and that executor's address."""
    busy = max((await executor_stats(stub)).values(), key=lambda ex: ex.running)
    assert busy.running > 0
    frozen = next(s for s in fleet.by_name("executor") if s.address == busy.address)
    frozen.freeze()
    try:
        return await asyncio.wait_for(asyncio.gather(*calls), 120), frozen.address
    finally:
        frozen.thaw()


async def test_a_frozen_executor_is_routed_around_with_no_token_lost_or_repeated(fleet, pushed):
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        expected = [(await client.generate(stub, r)).token_ids for r in requests()]
        assert all(len(tokens) == NUM_TOKENS for tokens in expected)

        first_tokens = asyncio.Event()
        started = [0]

        async def run(request) -> list[int]:
            tokens = []
            async for response in client.stream(stub, request):
                if response.HasField("token_id"):
                    tokens.append(response.token_id)
                    if len(tokens) == 1:
                        started[0] += 1
                        if started[0] == len(expected):
                            first_tokens.set()
            return tokens

        calls = [asyncio.create_task(run(r)) for r in requests()]
        await asyncio.wait_for(first_tokens.wait(), 60)
        before = await executor_stats(stub)
        got, frozen = await with_the_busiest_frozen(fleet, stub, calls)
        assert got == expected, "every stream completed with exactly its fault-free tokens"

        for _ in range(200):  # resumed, it answers Info and a probe step: it rejoins
            if (await executor_stats(stub))[frozen].is_up:
                break
            await asyncio.sleep(0.1)
        assert (await executor_stats(stub))[frozen].is_up
        rejoined = (await executor_stats(stub))[frozen]
        # Counters live for the scheduler's process: a rejoin does not set them back.
        counted = ("steps", "adapter_loads", "adapter_hits")
        assert all(getattr(rejoined, c) >= getattr(before[frozen], c) for c in counted), (
            rejoined, before[frozen])
        assert before[frozen].steps > 0 and before[frozen].adapter_loads > 0
        steps = rejoined.steps
        again = await asyncio.gather(*(client.generate(stub, r) for r in requests()))
        assert [g.token_ids for g in again] == expected
        assert (await executor_stats(stub))[frozen].steps > steps, "it gets work again"


@pytest.fixture(scope="module")
def small_kv_fleet(tiny, tmp_path_factory, log_dir):
    """KV for about two sequences at a time: more in flight are preempted and recomputed."""
    with Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("kv-store").as_uri(),
               log_dir=log_dir / "faults-kv",
               executor_args=["--kv-blocks", "12", "--block-size", "8", "--threads", "1"]) as f:
        yield f


async def test_seeded_sampling_gives_the_same_tokens_across_preemption(small_kv_fleet):
    request = client.generate_request("", "a seeded request", 40, temperature=1.0, top_k=50,
                                      seed=7, ignore_eos=True)
    async with insecure_channel(small_kv_fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        alone = (await client.generate(stub, request)).token_ids
        crowd = await asyncio.gather(*(client.generate(stub, request) for _ in range(6)))
    assert len(alone) == 40 and all(c.token_ids == alone for c in crowd)
