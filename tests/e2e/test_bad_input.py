"""Bad input on the scheduler's and the executor's gRPC surfaces gets a clear error with the right
status, never a crash, a hang, an INTERNAL status or a corrupted neighbour. Real services over
loopback gRPC; cases already covered in test_services.py (bad sampling ranges, unknown or foreign
adapters, prompt length, API keys) are not repeated here."""

import asyncio
import math
import time

import grpc
import pytest

from common.server import insecure_channel
from loraplex import client
from loraplex.launch import Fleet, start_service
from protos import common_pb2, executor_pb2, executor_pb2_grpc, scheduler_pb2

BLOCK = 16


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    with Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("store").as_uri(),
               log_dir=log_dir / "bad_input",
               executor_args=["--threads", "1", "--adapter-slots", "2"]) as fleet:
        yield fleet


@pytest.fixture(scope="module")
async def pushed(fleet, tiny):
    await client.push_adapter(fleet.stores[0], tiny["adapters"]["r4_attn"]["path"], "r4_attn")


async def rpc_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 30)
    return info.value


# ---- scheduler: Generate --------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-45, 1e-38])
async def test_tiny_positive_temperature_samples_like_greedy(fleet, stub, temperature):
    """logits / 1e-40 overflowed to inf, the executor's step failed (INTERNAL), the scheduler
    reconnected and replayed the request forever: it hung and preempted everyone else."""
    greedy_req = client.generate_request("", "tiny temperature", 6, ignore_eos=True)
    greedy = await client.generate(stub, greedy_req)
    req = client.generate_request("", "tiny temperature", 6, temperature=temperature, seed=1,
                                  ignore_eos=True)
    got = await asyncio.wait_for(client.generate(stub, req), 15)
    assert got.token_ids == greedy.token_ids and got.finish_reason == "FINISH_REASON_LENGTH"


async def test_huge_text_prompt_is_refused_without_tokenizing_it(fleet, stub):
    """A 16 MiB text was tokenized on the scheduler's event loop (seconds in which no stream moved)
    only to be refused for its length afterwards."""
    start = time.perf_counter()
    huge = client.generate_request("", "word " * (16 << 18), 4)
    err = await rpc_error(client.generate(stub, huge))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text" in err.details() and "characters" in err.details(), err.details()
    assert time.perf_counter() - start < 5


def with_fields(request: scheduler_pb2.GenerateRequest, **fields) -> scheduler_pb2.GenerateRequest:
    for name, value in fields.items():
        if isinstance(value, str):
            setattr(request, name, value)
        elif isinstance(value, list):
            getattr(request, name).extend(value)
        else:
            getattr(request, name).CopyFrom(value)
    return request


def no_prompt() -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(max_new_tokens=4)


@pytest.mark.parametrize("request_, words", [
    (no_prompt(), "prompt is empty"),
    (client.generate_request("", "hi", 4, temperature=math.inf), "temperature"),
    (client.generate_request("", "hi", 4, top_p=-0.5), "top_p"),
    (client.generate_request("", "hi", 4, top_p=math.nan), "top_p"),
    (client.generate_request("", "hi", 2**32 - 1), "max_new_tokens (4294967295)"),
    (client.generate_request("", "hi", 4, stop=["x"] * 17), "at most 16 stop strings"),
    (client.generate_request("", "hi", 4, stop=["x" * 257]), "at most 256 characters"),
    (client.generate_request("", "hi", 4, stop=["x", ""]), "stop strings must not be empty"),
    (with_fields(client.generate_request("", "hi", 4), stop_token_ids=[5, 10**6]),
     "stop_token_ids: token id 1000000 is outside the vocabulary"),
    (client.generate_request("", "hi", 4, cache_salt="s" * 257), "cache_salt must be at most"),
    (with_fields(client.generate_request("", "hi", 4), request_id="a b\nforged"), "request_id"),
    (with_fields(client.generate_request("", "hi", 4), request_id="x" * 65), "request_id"),
    (with_fields(client.generate_request("r4_attn", "hi", 4),
                 adapter_ref=common_pb2.AdapterRef(name="r4_attn", version=1)),
     "adapter or adapter_ref, not both"),
])
async def test_generate_requests_out_of_range(fleet, stub, request_, words):
    """Cases test_services.py does not already cover."""
    err = await rpc_error(client.generate(stub, request_))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details(), err.details()


@pytest.mark.parametrize("ref", ["a@", "@3", "a@b@c", "a@@1", "réfé", "a" * 10_000, "r4_attn\n",
                                 "r4_attn@0", "r4_attn@-1", "r4_attn@ 1", " r4_attn"])
async def test_malformed_adapter_refs_are_invalid_argument(fleet, pushed, stub, ref):
    err = await rpc_error(client.generate(stub, client.generate_request(ref, "hello", 2)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "is not of the form" in err.details()


# ---- scheduler: admin RPCs --------------------------------------------------------------------

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("method, request_, code, words", [
    ("Prewarm", scheduler_pb2.PrewarmRequest(adapter=""), INVALID_ARGUMENT, "not of the form"),
    ("Prewarm", scheduler_pb2.PrewarmRequest(adapter="r4_attn@0"), INVALID_ARGUMENT,
     "not of the form"),
    ("Prewarm", scheduler_pb2.PrewarmRequest(adapter="nope"), NOT_FOUND, "nope"),
    ("Prewarm", scheduler_pb2.PrewarmRequest(adapter="r4_attn@99"), NOT_FOUND, "version 99"),
    ("Evict", scheduler_pb2.EvictRequest(adapter="r4_attn", executor="127.0.0.1:1"), NOT_FOUND,
     "127.0.0.1:1"),
    ("Evict", scheduler_pb2.EvictRequest(adapter="a@b@c"), INVALID_ARGUMENT, "not of the form"),
    ("Evict", scheduler_pb2.EvictRequest(adapter="nope"), NOT_FOUND, "nope"),
    ("Drain", scheduler_pb2.DrainRequest(executor=""), NOT_FOUND, "no executor ''"),
])
async def test_admin_rpcs_with_bad_arguments(fleet, pushed, stub, method, request_, code, words):
    err = await rpc_error(getattr(stub, method)(request_))
    assert err.code() == code and words in err.details(), err.details()


async def test_prewarm_caps_num_executors_at_the_pool(fleet, pushed, stub):
    req = scheduler_pb2.PrewarmRequest(adapter="r4_attn", num_executors=2**32 - 1, wait=True)
    resp = await stub.Prewarm(req)
    assert client.ref_text(resp.adapter) == "r4_attn@1" and len(resp.executors) == 1


# ---- executor: the Step stream ------------------------------------------------------------------

STEP_IDLE_S = 3.0  # (the default is 60 s)


@pytest.fixture(scope="module")
def executor(tiny, log_dir):
    """An executor of its own: the fleet's is driven by its scheduler. No store is reachable."""
    args = ["--model", tiny["model_dir"], "--store", "127.0.0.1:9", "--threads", "1",
            "--kv-blocks", "512", "--block-size", str(BLOCK), "--adapter-slots", "2",
            "--step-idle-s", str(STEP_IDLE_S)]
    service = start_service("bad-input-executor", "executor.service", args, log_dir / "bad_input")
    yield service.address
    service.stop()


@pytest.fixture
async def ex_stub(executor):
    async with insecure_channel(executor) as channel:
        yield executor_pb2_grpc.ExecutorStub(channel)


def new_seq(seq_id: int, token_ids: list[int], **sampling) -> executor_pb2.NewSequence:
    return executor_pb2.NewSequence(seq_id=seq_id, token_ids=token_ids, slot=-1,
                                    sampling=common_pb2.SamplingParams(**sampling))


def rows(*specs: tuple[int, int, list[int]]) -> dict:
    """StepRequest's row columns for rows of (seq id, tokens, new block ids)."""
    return dict(row_seq_ids=[s[0] for s in specs], row_num_tokens=[s[1] for s in specs],
                row_num_new_blocks=[len(s[2]) for s in specs],
                new_block_ids=[b for s in specs for b in s[2]])


async def open_step(ex_stub):
    """A Step stream, once the executor takes one (the scheduler retries the same way)."""
    for _ in range(100):
        call = ex_stub.Step()
        try:
            await call.write(executor_pb2.StepRequest())
            await call.read()
            return call
        except grpc.aio.AioRpcError:  # a write to a refused stream fails with a status of its own
            if await call.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
        await asyncio.sleep(0.05)
    raise AssertionError("the executor never took a new Step stream")


async def greedy_tokens(call, seq_id: int, prompt: list[int], num: int,
                        pause_s: float = 0.0) -> list[int]:
    """Prefill `prompt` into block 0 onwards, then decode: `num` greedy tokens in all."""
    await call.write(executor_pb2.StepRequest(new_sequences=[new_seq(seq_id, prompt)],
                                              **rows((seq_id, len(prompt), [0]))))
    tokens = [(await call.read()).sample_token_ids[0]]
    while len(tokens) < num:
        position = len(prompt) + len(tokens) - 1  # of the token computed now
        blocks = [position // BLOCK] if position % BLOCK == 0 else []
        await call.write(executor_pb2.StepRequest(**rows((seq_id, 1, blocks))))
        tokens.append((await call.read()).sample_token_ids[0])
        await asyncio.sleep(pause_s)
    return tokens


async def test_second_step_stream_is_refused_until_the_first_ends(ex_stub):
    first = await open_step(ex_stub)
    err = await rpc_error(ex_stub.Step().read())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "already driven" in err.details()
    first.cancel()
    (await open_step(ex_stub)).cancel()


@pytest.mark.parametrize("step, words", [
    (executor_pb2.StepRequest(**rows((77, 1, []))), "unknown sequence id 77"),
    (executor_pb2.StepRequest(row_seq_ids=[1], row_num_tokens=[1]), "differ in length"),
    (executor_pb2.StepRequest(row_seq_ids=[1], row_num_tokens=[1], row_num_new_blocks=[2],
                              new_block_ids=[0]), "add 2 KV blocks"),
    (executor_pb2.StepRequest(new_sequences=[new_seq(1, [5]), new_seq(1, [6])]), "already exists"),
    (executor_pb2.StepRequest(new_sequences=[new_seq(1, [5])], **rows((1, 1, [512]))),
     "block id 512"),
    (executor_pb2.StepRequest(new_sequences=[new_seq(1, [5], temperature=float("nan"))]),
     "temperature"),
    (executor_pb2.StepRequest(new_sequences=[new_seq(1, [5], top_p=float("inf"))]), "top_p"),
    (executor_pb2.StepRequest(new_sequences=[new_seq(1, [])]), "empty prompt"),
    (executor_pb2.StepRequest(
        new_sequences=[executor_pb2.NewSequence(seq_id=1, token_ids=[5], slot=-2)]), "slot -2"),
])
async def test_bad_step_is_invalid_argument_and_frees_the_executor(ex_stub, step, words):
    call = await open_step(ex_stub)
    await call.write(step)
    err = await rpc_error(call.read())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details(), err.details()
    (await open_step(ex_stub)).cancel()  # the failed stream let go of the executor


async def test_a_stream_that_goes_silent_ends_and_frees_the_executor(ex_stub):
    """A scheduler whose event loop hangs still answers keepalive pings: its Step stream, silent
    with every step answered, must not hold the executor (and its sequences) for good."""
    call = await open_step(ex_stub)
    await call.write(executor_pb2.StepRequest(new_sequences=[new_seq(1, [5, 6, 7])],
                                              **rows((1, 3, [0]))))
    await call.read()
    assert await asyncio.wait_for(call.read(), STEP_IDLE_S + 30) is grpc.aio.EOF
    (await open_step(ex_stub)).cancel()  # another scheduler may drive it: it forgot the first's
    assert (await ex_stub.Info(executor_pb2.InfoRequest())).num_sequences == 0


async def test_stream_cancelled_mid_step_does_not_touch_the_next_stream(ex_stub):
    """A cancelled stream's step ran on in its thread beside the next stream's steps: it wrote its
    KV into blocks the new stream had been given and counted its tokens into the new stream's
    sequence of the same id, whose greedy tokens then differed from a clean run's."""
    prompt = [7, 8, 9, 10, 11]
    call = await open_step(ex_stub)
    expected = await greedy_tokens(call, 1, prompt, 10)
    call.cancel()
    big = await open_step(ex_stub)  # two 1500-token prefills in blocks 0..187: most of a second
    per = 1500 // BLOCK + 1
    await big.write(executor_pb2.StepRequest(
        new_sequences=[new_seq(i, [5 + j % 50 for j in range(1500)]) for i in (1, 2)],
        **rows(*((i, 1500, list(range((i - 1) * per, i * per))) for i in (1, 2)))))
    await asyncio.sleep(0.1)
    big.cancel()
    call = await open_step(ex_stub)
    assert await greedy_tokens(call, 1, prompt, 10, pause_s=0.1) == expected
    call.cancel()
