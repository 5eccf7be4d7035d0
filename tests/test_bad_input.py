"""Bad input on the scheduler's and the executor's gRPC surfaces gets a clear error with the right
status, never a crash, a hang, an INTERNAL status or a corrupted neighbour. Real services over
loopback gRPC; cases already covered in test_services.py (bad sampling ranges, unknown or foreign
adapters, prompt length, API keys) are not repeated here."""

import asyncio
import time

import grpc
import pytest

from loraplex import client
from loraplex.launch import Fleet
from loraplex.server import insecure_channel
from protos import scheduler_pb2, scheduler_pb2_grpc

BLOCK = 16


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    with Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("store").as_uri(),
               log_dir=log_dir / "bad_input", executor_args=["--threads", "1", "--adapter-slots", "2"]) as fleet:
        yield fleet


@pytest.fixture(scope="module")
async def pushed(fleet, tiny):
    await client.push_adapter(fleet.stores[0], tiny["adapters"]["r4_attn"]["path"], "r4_attn")


@pytest.fixture
async def stub(fleet):
    async with insecure_channel(fleet.scheduler) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


async def rpc_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 30)
    return info.value


# ---- scheduler: Generate --------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-45, 1e-38])
async def test_tiny_positive_temperature_samples_like_greedy(fleet, stub, temperature):
    """logits / 1e-40 overflowed to inf, the executor's step failed (INTERNAL), the scheduler
    reconnected and replayed the request forever: it hung and preempted everyone else."""
    greedy = await client.generate(stub, client.generate_request("", "tiny temperature", 6, ignore_eos=True))
    req = client.generate_request("", "tiny temperature", 6, temperature=temperature, seed=1, ignore_eos=True)
    got = await asyncio.wait_for(client.generate(stub, req), 15)
    assert got.token_ids == greedy.token_ids and got.finish_reason == "FINISH_REASON_LENGTH"


async def test_huge_text_prompt_is_refused_without_tokenizing_it(fleet, stub):
    """A 16 MiB text was tokenized on the scheduler's event loop (seconds in which no stream moved)
    only to be refused for its length afterwards."""
    start = time.perf_counter()
    err = await rpc_error(client.generate(stub, client.generate_request("", "word " * (16 << 18), 4)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text" in err.details() and "characters" in err.details(), err.details()
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("ref", ["a@", "@3", "a@b@c", "a@@1", "réfé", "a" * 10_000, "r4_attn\n",
                                 "r4_attn@0", "r4_attn@-1", "r4_attn@ 1", " r4_attn"])
async def test_malformed_adapter_refs_are_invalid_argument(fleet, pushed, stub, ref):
    err = await rpc_error(client.generate(stub, client.generate_request(ref, "hello", 2)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "is not of the form" in err.details()


# ---- scheduler: admin RPCs --------------------------------------------------------------------

@pytest.mark.parametrize("method, request_, code, words", [
    ("Prewarm", scheduler_pb2.PrewarmRequest(adapter=""), grpc.StatusCode.INVALID_ARGUMENT, "not of the form"),
    ("Prewarm", scheduler_pb2.PrewarmRequest(adapter="r4_attn@0"), grpc.StatusCode.INVALID_ARGUMENT, "not of the form"),
    ("Prewarm", scheduler_pb2.PrewarmRequest(adapter="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
    ("Prewarm", scheduler_pb2.PrewarmRequest(adapter="r4_attn@99"), grpc.StatusCode.NOT_FOUND, "version 99"),
    ("Evict", scheduler_pb2.EvictRequest(adapter="r4_attn", executor="127.0.0.1:1"), grpc.StatusCode.NOT_FOUND,
     "127.0.0.1:1"),
    ("Evict", scheduler_pb2.EvictRequest(adapter="a@b@c"), grpc.StatusCode.INVALID_ARGUMENT, "not of the form"),
    ("Evict", scheduler_pb2.EvictRequest(adapter="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
    ("Drain", scheduler_pb2.DrainRequest(executor=""), grpc.StatusCode.NOT_FOUND, "no executor ''"),
])
async def test_admin_rpcs_with_bad_arguments(fleet, pushed, stub, method, request_, code, words):
    err = await rpc_error(getattr(stub, method)(request_))
    assert err.code() == code and words in err.details(), err.details()


async def test_prewarm_caps_num_executors_at_the_pool(fleet, pushed, stub):
    resp = await stub.Prewarm(scheduler_pb2.PrewarmRequest(adapter="r4_attn", num_executors=2**32 - 1, wait=True))
    assert resp.adapter == "r4_attn@1" and len(resp.executors) == 1
