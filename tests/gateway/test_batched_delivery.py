"""Batched delivery (scheduler.proto Stream): through the gateway, which takes token ids in
batches from the scheduler and detokenizes and applies stop strings itself, every client gets
message for message what the scheduler's own Generate (which detokenizes per token) gives it:
tokens, text, finish reasons and usage, with stop strings that span tokens, multi-byte characters
held back until complete, and cancellation mid-stream freeing the request at the scheduler."""

import asyncio
import collections
import pathlib

import grpc
import pytest
from tokenizers import Tokenizer

from common.server import insecure_channel
from loraplex import client
from loraplex.fixtures import MODEL_ID
from loraplex.launch import Fleet, start_gateway
from protos import scheduler_pb2, scheduler_pb2_grpc

ADAPTERS = ("r4_attn", "r8_mlp", "r16_all", "r2_q")
PROMPTS = ("The little cat", "Seven quiet rivers", "A model serves many", "Bright")


@pytest.fixture(scope="module")
def pool(tiny, tmp_path_factory, log_dir):
    logs = log_dir / "batched-delivery"
    fleet = Fleet(model=tiny["model_dir"], log_dir=logs, store_url=tmp_path_factory.mktemp(
        "batched-store").as_uri(), executor_args=["--adapter-slots", "4", "--threads", "1"])
    gateway = None
    try:
        fleet.start()
        for name in ADAPTERS:
            asyncio.run(client.push_adapter(fleet.stores[0], tiny["adapters"][name]["path"], name))
        gateway = start_gateway({MODEL_ID: [fleet.scheduler]}, fleet.stores, logs)
        yield fleet, gateway
    finally:
        for part in (gateway, fleet):
            if part is not None:
                part.stop()


async def messages(address: str, request: scheduler_pb2.GenerateRequest) -> list[tuple]:
    """Every message of one Generate: (token id or None, text, finish reason, prompt and
    completion tokens of the usage), and the logprobs apart."""
    out, logprobs = [], []
    async with insecure_channel(address) as channel:
        async for m in scheduler_pb2_grpc.SchedulerStub(channel).Generate(request, timeout=120):
            out.append((m.token_id if m.HasField("token_id") else None, m.text, m.finish_reason,
                        m.usage.prompt_tokens, m.usage.completion_tokens))
            if m.HasField("token_id"):
                logprobs.append(m.logprob)
    return out, logprobs


async def both(pool, request) -> tuple[list[tuple], list[tuple]]:
    """The same request through the scheduler's Generate and through the gateway."""
    fleet, gateway = pool
    (direct, direct_lp), (batched, batched_lp) = await asyncio.gather(
        messages(fleet.scheduler, request), messages(gateway.address, request))
    assert batched_lp == pytest.approx(direct_lp, abs=1e-4)
    return direct, batched


def tokenizer_of(tiny) -> Tokenizer:
    return Tokenizer.from_file(str(pathlib.Path(tiny["model_dir"]) / "tokenizer.json"))


async def test_every_client_gets_what_generate_gives(pool, tiny):
    tokenizer = tokenizer_of(tiny)
    requests = [client.generate_request(adapter, prompt, 24, ignore_eos=ignore_eos)
                for adapter in ("", *ADAPTERS) for prompt in PROMPTS
                for ignore_eos in (False, True)]
    answers = await asyncio.gather(*(both(pool, r) for r in requests))
    for direct, batched in answers:
        assert batched == direct
    outputs = [[m[0] for m in direct if m[0] is not None] for direct, _ in answers]
    # The workload holds byte tokens of multi-byte characters (their text waits for the rest).
    assert any("\ufffd" in tokenizer.decode([t]) for ids in outputs for t in ids)

    # Stop strings that span two tokens: the last two characters of one token's text and the
    # first of the next, from each ignore_eos answer; plus one that never matches.
    stopped = []
    for request, (direct, _) in zip(requests, answers):
        if not request.ignore_eos:
            continue
        texts = [m[1] for m in direct if m[0] is not None]
        spans = [a[-2:] + b[:1] for a, b in zip(texts[4:], texts[5:]) if len(a) >= 2 and b]
        if spans:
            with_stop = scheduler_pb2.GenerateRequest()
            with_stop.CopyFrom(request)
            with_stop.stop[:] = [spans[0], "never in any output \u00e9"]
            stopped.append(with_stop)
    assert len(stopped) >= 8
    for direct, batched in await asyncio.gather(*(both(pool, r) for r in stopped)):
        assert batched == direct
        assert direct[-1][2] == scheduler_pb2.FINISH_REASON_STOP


async def test_the_gateway_keeps_the_schedulers_stop_string_limits(pool):
    _, gateway = pool
    for stop, words in ((["ab"] * 17, "at most 16 stop strings"),
                        (["x" * 257], "at most 256 characters")):
        request = client.generate_request(ADAPTERS[0], PROMPTS[0], 4, stop=stop)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await messages(gateway.address, request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in refused.value.details()


async def scheduler_totals(fleet: Fleet) -> tuple[int, int]:
    """(running or queued requests, completion tokens counted) over the pool's tenants."""
    async with insecure_channel(fleet.scheduler) as channel:
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).Stats(
            scheduler_pb2.StatsRequest(), timeout=10)
    return (sum(t.running + t.queued for t in stats.tenants),
            sum(t.completion_tokens for t in stats.tenants))


async def ended_at_scheduler(fleet: Fleet) -> int:
    """Once nothing runs or waits there: the completion tokens the scheduler counted."""
    for _ in range(300):
        busy, tokens = await scheduler_totals(fleet)
        if not busy:
            return tokens
        await asyncio.sleep(0.1)
    pytest.fail("a request the gateway ended still runs at the scheduler")


async def test_a_stop_string_or_a_client_that_leaves_ends_the_request_at_the_scheduler(pool):
    fleet, gateway = pool
    long = 400  # far more than a request that ends early computes before its cancel lands
    _, before = await scheduler_totals(fleet)
    request = client.generate_request(ADAPTERS[0], PROMPTS[0], long, ignore_eos=True)
    direct, _ = await messages(fleet.scheduler, client.generate_request(
        ADAPTERS[0], PROMPTS[0], 8, ignore_eos=True))
    stop = "".join(m[1] for m in direct[2:5])  # matched at the gateway, a few tokens in
    request.stop[:] = [stop]
    answer, _ = await messages(gateway.address, request)
    assert answer[-1][2] == scheduler_pb2.FINISH_REASON_STOP and answer[-1][4] < 8
    after_stop = await ended_at_scheduler(fleet)
    assert after_stop - before < long

    async with insecure_channel(gateway.address) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Generate(
            client.generate_request(ADAPTERS[1], PROMPTS[1], long, ignore_eos=True), timeout=120)
        got = [await anext(aiter(call)) for _ in range(3)]
        call.cancel()
    assert [m.token_id for m in got] == [m[0] for m in (await messages(
        fleet.scheduler, client.generate_request(ADAPTERS[1], PROMPTS[1], 3)))[0][:3]]
    assert await ended_at_scheduler(fleet) - after_stop < long


async def stream_once(fleet: Fleet, *requests: scheduler_pb2.StreamRequest,
                      wanted: dict[int, int] | None = None) -> dict[int, dict]:
    """Send `requests` on one Stream; per request id: its tokens, its start and its end, once
    every submit has ended (or those of `wanted`: id -> ends due)."""
    wanted = collections.Counter(wanted or [s.id for r in requests for s in r.submits])
    by_id: dict[int, dict] = collections.defaultdict(lambda: {"tokens": []})
    async with insecure_channel(fleet.scheduler) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Stream(timeout=60)
        for request in requests:
            await call.write(request)
        ended: collections.Counter = collections.Counter()
        while ended != wanted:
            response = await call.read()
            for stream_id, token_id in zip(response.token_request_ids, response.token_ids):
                by_id[stream_id]["tokens"].append(token_id)
            for start in response.starts:
                by_id[start.id]["start"] = start
            for end in response.ends:
                by_id[end.id]["end"] = end
                ended[end.id] += 1
        await call.done_writing()
        # Nothing left to send and the caller done: the scheduler ends the stream.
        assert await call.read() is grpc.aio.EOF
    return by_id


async def test_the_stream_rpc_directly(pool, tiny):
    fleet, _ = pool
    prompt = tokenizer_of(tiny).encode(PROMPTS[0]).ids

    def submit(stream_id: int, **fields) -> scheduler_pb2.StreamSubmit:
        request = scheduler_pb2.GenerateRequest(adapter=ADAPTERS[2], max_new_tokens=12,
                                                token_ids=scheduler_pb2.TokenIds(ids=prompt),
                                                ignore_eos=True, **fields)
        return scheduler_pb2.StreamSubmit(id=stream_id, request=request, tenant="t")

    updates = await stream_once(fleet, scheduler_pb2.StreamRequest(
        submits=[submit(1), submit(2, stop=["x"])], cancels=[99]))
    direct, _ = await messages(fleet.scheduler, client.generate_request(
        ADAPTERS[2], prompt, 12, ignore_eos=True))
    assert updates[1]["tokens"] == [m[0] for m in direct if m[0] is not None]
    assert updates[1]["end"].finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
    assert updates[1]["start"].time_to_first_token_seconds > 0
    refused = updates[2]["end"]
    assert refused.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "stop strings" in refused.error_message and not updates[2]["tokens"]

    # A message that cancels its own submit: the request never runs.
    _, tokens_before = await scheduler_totals(fleet)
    updates = await stream_once(fleet, scheduler_pb2.StreamRequest(
        submits=[submit(3)], cancels=[3]), scheduler_pb2.StreamRequest(submits=[submit(4)]),
        wanted={4: 1})
    assert 3 not in updates and len(updates[4]["tokens"]) == 12
    assert await ended_at_scheduler(fleet) - tokens_before == 12

    with pytest.raises(grpc.aio.AioRpcError) as reused:  # an id reused while its request runs
        await stream_once(fleet, scheduler_pb2.StreamRequest(submits=[submit(1), submit(1)]))
    assert reused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in use" in reused.value.details()
    assert await ended_at_scheduler(fleet) >= 0  # and the stream's running request was cancelled
