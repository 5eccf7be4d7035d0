"""Tensor-parallel executors over real gRPC through the services: `python -m executor.service
--tensor-parallel N` (a supervisor and N gloo rank processes on CPU) is one executor to its
scheduler. With 2 and 4 ranks (the fixture model's 2 KV heads split, then replicated), mixed
adapters in one batch (all projections, MLP only, rank patterns, one projection) beside the base
model, with cached prefixes, give HF + PEFT's greedy tokens (so TP=1's: tests/executor/
test_tensor_parallel_oracle.py compares logits). A rank SIGKILLed or frozen (SIGSTOP) mid-
generation ends the executor's Step stream: every stream completes on the TP=1 executor beside it
with exactly its fault-free tokens, and the group restarts as one and gets work again (after a
freeze, once rank 0's collective has waited --rank-timeout-s for the frozen rank). Rank 0 frozen
while idle is restarted once its follower has heard no heartbeat for as long."""

import asyncio
import contextlib
import os
import pathlib
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.server import insecure_channel
from loraplex import client
from loraplex.launch import ServiceProcess, start_service
from protos import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.oracle import hf_greedy

# A step is overdue after 2 s (the first steps of a connection after 4 s), an idle executor is
# probed every 0.5 s (as tests/e2e/test_faults_executor.py).
FAST_FAILOVER = ["--step-floor-s", "2", "--step-warmup-s", "4", "--warmup-steps", "2",
                 "--probe-interval-s", "0.5", "--rpc-s", "2"]
ADAPTERS = ("r16_all", "r8_mlp", "r8_patterns", "r2_q", "")  # "": the base model
BLOCK = 8
RANK_TIMEOUT_S = 10  # (--rank-timeout-s: how long a collective or a silent rank 0 is waited for)
SYSTEM = [random.Random(5).randrange(2, 1000) for _ in range(3 * BLOCK)]  # a shared prefix


def start_all(specs: list[tuple[str, str, list[str]]], log_dir: pathlib.Path) -> list:
    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(lambda s: start_service(s[0], s[1], s[2], log_dir), specs))


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory, log_dir):
    """A store; executors of 2, 4 and 1 ranks; scheduler "tp2" drives the TP=2 and the TP=1 one,
    scheduler "tp4" the TP=4 one."""
    logs = log_dir / "tensor-parallel"
    services: list[ServiceProcess] = []
    try:
        services += start_all([("store", "adapter_store.service",
                                ["--url", tmp_path_factory.mktemp("tp-store").as_uri()])], logs)
        flags = ["--model", tiny["model_dir"], "--store", services[0].address, "--threads", "1",
                 "--adapter-slots", "6", "--kv-blocks", "192", "--block-size", str(BLOCK),
                 "--rank-timeout-s", str(RANK_TIMEOUT_S)]
        tp2, tp4, tp1 = start_all([
            ("executor-tp2", "executor.service", [*flags, "--tensor-parallel", "2"]),
            ("executor-tp4", "executor.service", [*flags, "--tensor-parallel", "4"]),
            ("executor-tp1", "executor.service", flags)], logs)
        services += [tp2, tp4, tp1]
        schedulers = start_all([
            ("scheduler-tp2", "scheduler.service", ["--store", services[0].address,
                                                    "--executor", tp2.address, "--executor",
                                                    tp1.address, *FAST_FAILOVER]),
            ("scheduler-tp4", "scheduler.service", ["--store", services[0].address,
                                                    "--executor", tp4.address])], logs)
        services += schedulers
        yield {"store": services[0].address, "executors": {2: tp2, 4: tp4, 1: tp1},
               "schedulers": {2: schedulers[0].address, 4: schedulers[1].address}}
    finally:
        for service in reversed(services):
            service.terminate()
        for service in reversed(services):
            service.wait_stopped(10)


@pytest.fixture(scope="module")
async def pushed(world, tiny):
    for name in ADAPTERS[:-1]:
        await client.push_adapter(world["store"], tiny["adapters"][name]["path"], name)


def jobs(seed: int, with_prefix: bool) -> list[tuple[str, list[int]]]:
    """Two prompts per adapter (and the base model); with the shared system prefix or not."""
    rng = random.Random(seed)
    return [(a, (SYSTEM if with_prefix else []) + [rng.randrange(2, 1000)
                                                    for _ in range(rng.randint(3, 12))])
            for a in ADAPTERS for _ in range(2)]


async def stats(stub) -> dict[str, scheduler_pb2.ExecutorStats]:
    return {ex.address: ex for ex in (await stub.Stats(scheduler_pb2.StatsRequest())).executors}


@pytest.mark.parametrize("ranks", [2, 4])
async def test_mixed_adapters_match_hf_peft(world, pushed, hf_peft, ranks):
    executor = world["executors"][ranks]
    async with insecure_channel(executor.address) as channel:
        info = await executor_pb2_grpc.ExecutorStub(channel).Info(executor_pb2.InfoRequest())
    assert info.tensor_parallel_size == ranks
    async with insecure_channel(world["schedulers"][ranks]) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        if ranks == 2:  # every request on the TP=2 executor
            await stub.Drain(scheduler_pb2.DrainRequest(executor=world["executors"][1].address))

        async def one(adapter: str, prompt: list[int]) -> list[int]:
            request = client.generate_request(adapter, prompt, 8, ignore_eos=True)
            return (await client.generate(stub, request)).token_ids

        first = jobs(1, with_prefix=True)[::2]  # one per adapter computes the prefix
        rest = jobs(2, with_prefix=True)[1::2] + jobs(3, with_prefix=False)
        got = [await one(a, p) for a, p in first] + list(
            await asyncio.gather(*(one(a, p) for a, p in rest)))  # mixed in one batch
        for (adapter, prompt), tokens in zip(first + rest, got):
            assert tokens == hf_greedy(hf_peft, prompt, 8, adapter or None)[0], adapter
        ex = (await stats(stub))[executor.address]
        assert ex.steps > 0
        tenants = (await stub.Stats(scheduler_pb2.StatsRequest())).tenants
        cached = sum(t.cached_prompt_tokens for t in tenants)
        assert cached >= len(ADAPTERS) * len(SYSTEM), "the second prompt of each adapter hits"
        if ranks == 2:
            await stub.Resume(scheduler_pb2.ResumeRequest(executor=world["executors"][1].address))


def rank_pid(supervisor: ServiceProcess, rank: int) -> int:
    """The pid of rank `rank` of a tensor-parallel executor (a child of its supervisor)."""
    pid = supervisor.process.pid
    for child in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        argv = pathlib.Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        module = b"executor.tp.rank"
        if module in argv and argv[argv.index(module) + 1] == b"%d" % rank:
            return int(child)
    raise LookupError(f"no rank {rank} under pid {pid}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
async def test_a_rank_lost_mid_generation_loses_and_repeats_no_token(world, pushed, hf_peft, sig):
    rank = 1
    tp2 = world["executors"][2]
    requests = jobs(4, with_prefix=False)
    expected = [hf_greedy(hf_peft, p, 40, a or None)[0] for a, p in requests]
    async with insecure_channel(world["schedulers"][2]) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        started = asyncio.Event()
        first_tokens = [0]

        async def run(adapter: str, prompt: list[int]) -> list[int]:
            tokens = []
            request = client.generate_request(adapter, prompt, 40, ignore_eos=True)
            async for response in client.stream(stub, request):
                if response.HasField("token_id"):
                    tokens.append(response.token_id)
                    if len(tokens) == 1:
                        first_tokens[0] += 1
                        if first_tokens[0] == len(requests):
                            started.set()
            return tokens

        calls = [asyncio.create_task(run(a, p)) for a, p in requests]
        await asyncio.wait_for(started.wait(), 60)
        assert (await stats(stub))[tp2.address].running > 0, "the TP=2 executor has work"
        victim = rank_pid(tp2, rank)
        os.kill(victim, sig)
        got = await asyncio.wait_for(asyncio.gather(*calls), 120)
        assert got == expected, "every stream completed with exactly its fault-free tokens"
        assert tp2.process.poll() is None, "the supervisor lives on"

        for _ in range(600):  # the group restarts as one, and its scheduler takes it back
            ex = (await stats(stub))[tp2.address]
            if ex.is_up and rank_pid(tp2, rank) != victim:
                break
            await asyncio.sleep(0.1)
        assert ex.is_up and rank_pid(tp2, rank) != victim
        steps = ex.steps
        again = await asyncio.gather(*(run(a, p) for a, p in requests[:4]))
        assert again == expected[:4]
        await stub.Drain(scheduler_pb2.DrainRequest(executor=world["executors"][1].address))
        alone = await asyncio.gather(*(run(a, p) for a, p in requests[4:6]))
        assert alone == expected[4:6]
        assert (await stats(stub))[tp2.address].steps > steps, "it gets work again"
        await stub.Resume(scheduler_pb2.ResumeRequest(executor=world["executors"][1].address))


async def test_rank_0_frozen_while_idle_is_restarted_by_its_followers(world, pushed, hf_peft):
    """Rank 0 frozen between steps: no collective waits on it, and its follower sits reading
    its socket; hearing nothing from rank 0 (neither the scheduler's probe steps nor rank 0's
    heartbeats, which keep a group with no scheduler alive: test_followers.py) it ends within
    --rank-timeout-s, the supervisor restarts the group, and it serves again."""
    tp2 = world["executors"][2]
    adapter, prompt = jobs(1, with_prefix=False)[0]
    expected = hf_greedy(hf_peft, prompt, 8, adapter or None)[0]
    async with insecure_channel(world["schedulers"][2]) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        await stub.Drain(scheduler_pb2.DrainRequest(executor=world["executors"][1].address))
        victim = rank_pid(tp2, 0)
        os.kill(victim, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 120  # (detection, restart back-off, start: loaded)
            while time.monotonic() < deadline:
                ex = (await stats(stub))[tp2.address]
                if ex.is_up and rank_pid(tp2, 0) != victim:
                    break
                await asyncio.sleep(0.1)
            assert ex.is_up and rank_pid(tp2, 0) != victim, "the group restarted"
            request = client.generate_request(adapter, prompt, 8, ignore_eos=True)
            assert (await client.generate(stub, request)).token_ids == expected
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)
            await stub.Resume(scheduler_pb2.ResumeRequest(
                executor=world["executors"][1].address))
