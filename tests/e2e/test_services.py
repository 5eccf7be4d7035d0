"""End to end: three services as separate processes over loopback gRPC, adapters in a real S3
server (SeaweedFS), outputs checked against HF transformers + PEFT."""

import asyncio
import json
import math
import random

import grpc
import pytest
from tokenizers import Tokenizer

from loraplex import client
from loraplex.launch import Fleet, FleetKeys
from protos import scheduler_pb2
from scheduler.sim.cost_fit import fit_cost
from tests.conftest import API_KEYS, KEY_OF
from tests.oracle import hf_greedy

NUM_SLOTS, MAX_RANK, KV_BLOCKS, BLOCK = 6, 32, 256, 8
# Who owns which fixture adapter: one public, the rest private to one tenant each.
OWNERS = {"r4_attn": "", "r8_mlp": "acme", "r16_all": "acme", "r32_all": "globex", "r2_q": "globex",
          "r1_down": "initech", "r8_rslora": "initech", "r8_patterns": "acme", "r12_vo": "globex",
          "r24_k_up": "initech"}


@pytest.fixture(scope="module")
def fleet(tiny, seaweedfs_s3, log_dir):
    fleet = Fleet(model=tiny["model_dir"], store_url=f"s3://{seaweedfs_s3.bucket}/fleet",
                  log_dir=log_dir, store_args=["--s3-endpoint-url", seaweedfs_s3.endpoint_url],
                  executor_args=["--adapter-slots", str(NUM_SLOTS), "--max-rank", str(MAX_RANK),
                                 "--kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK),
                                 "--threads", "1"],
                  keys=FleetKeys(tenants=API_KEYS),
                  scheduler_args=["--rate-limit", "limited=0.02:0",
                                  "--timings-out", str(log_dir / "timings.jsonl")])
    with fleet:
        yield fleet


@pytest.fixture(scope="module")
async def pushed(fleet, tiny):
    """Push every valid fixture adapter; returns name -> AdapterInfo."""
    infos = {}
    for name, owner in OWNERS.items():
        infos[name] = await client.push_adapter(fleet.stores[0], tiny["adapters"][name]["path"],
                                                name, owner, key=fleet.keys.admin)
    for name in ("other_base", "r64"):
        infos[name] = await client.push_adapter(fleet.stores[0], tiny["adapters"][name]["path"],
                                                name, key=fleet.keys.admin)
    return infos


def _prompts(tiny, n: int) -> list[str]:
    rng = random.Random(7)
    words = ["the", "model", "serves", "many", "adapters", "tokens", "stream", "quickly", "a",
             "batch"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(n)]


async def test_50_concurrent_streams_across_10_adapters_match_hf_peft(fleet, pushed, stub, tiny,
                                                                      hf_peft):
    tokenizer = Tokenizer.from_file(f"{tiny['model_dir']}/tokenizer.json")
    names = list(OWNERS)
    jobs = [(names[i % len(names)], prompt) for i, prompt in enumerate(_prompts(tiny, 50))]
    num_tokens = 12

    async def one(adapter: str, prompt: str) -> client.Generation:
        tenant = OWNERS[adapter] or "acme"
        req = client.generate_request(adapter, prompt, max_new_tokens=num_tokens, ignore_eos=True)
        return await client.generate(stub, req, KEY_OF[tenant])

    results = await asyncio.gather(*(one(a, p) for a, p in jobs))
    for (adapter, prompt), got in zip(jobs, results):
        expected, _ = hf_greedy(hf_peft, tokenizer.encode(prompt).ids, num_tokens, adapter)
        assert got.token_ids == expected, f"{adapter}: {prompt!r}"
        assert got.finish_reason == "FINISH_REASON_LENGTH"
        assert got.usage.completion_tokens == num_tokens
        assert client.ref_text(got.usage.adapter) == f"{adapter}@{pushed[adapter].version}"
        assert got.text == tokenizer.decode(expected)
    stats = await stub.Stats(scheduler_pb2.StatsRequest(),
                             metadata=client.metadata(fleet.keys.admin))
    (ex,) = stats.executors
    # Every block is free again but the resident adapters' pages (cached prefixes count free).
    assert ex.running == 0 and ex.free_kv_blocks + ex.adapter_pages == KV_BLOCKS
    assert ex.adapter_pages == sum(slot.num_pages for slot in ex.slots) > 0
    assert ex.adapter_loads >= len(OWNERS)  # 10 adapters through 6 slots: loads and evictions
    assert all(slot.pins == 0 for slot in ex.slots)
    assert {t.tenant for t in stats.tenants} >= {"acme", "globex", "initech"}


async def _cached_prompt_tokens(fleet, stub, tenant: str) -> int:
    stats = await stub.Stats(scheduler_pb2.StatsRequest(),
                             metadata=client.metadata(fleet.keys.admin))
    return next((t.cached_prompt_tokens for t in stats.tenants if t.tenant == tenant), 0)


async def test_a_shared_prefix_comes_from_the_cache_with_the_oracles_tokens(fleet, pushed, stub,
                                                                           hf_peft):
    """A 40-token system prompt (5 blocks) then short turns, on the base model and two adapters:
    after one request per adapter, the others reuse its blocks (the tenant's cached prompt
    tokens say so) and every answer is HF PEFT's. Another cache_salt gets no hit."""
    rng = random.Random(3)
    system = [rng.randrange(2, 1000) for _ in range(5 * BLOCK)]
    turns = [[rng.randrange(2, 1000) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    adapters = ["", "r16_all", "r8_mlp"]

    async def one(adapter: str, turn: list[int], tenant: str = "acme", salt: str = "") -> None:
        prompt = system + turn
        req = client.generate_request(adapter, prompt, 6, ignore_eos=True, cache_salt=salt)
        got = await client.generate(stub, req, KEY_OF[tenant])
        assert got.token_ids == hf_greedy(hf_peft, prompt, 6, adapter or None)[0], adapter

    before = await _cached_prompt_tokens(fleet, stub, "acme")
    for adapter in adapters:  # computes the system prompt once per adapter
        await one(adapter, turns[0])
    await asyncio.gather(*(one(a, t) for a in adapters for t in turns[1:]))
    after = await _cached_prompt_tokens(fleet, stub, "acme")
    assert after - before >= len(adapters) * 3 * len(system)

    before = await _cached_prompt_tokens(fleet, stub, "initech")
    for salt in ("s1", "s2", "s1"):
        await one("r1_down", turns[0], "initech", salt)
    assert await _cached_prompt_tokens(fleet, stub, "initech") - before == len(system)


async def test_stats_need_a_key_and_show_a_tenant_its_own_counters_only(fleet, pushed, stub):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Stats(scheduler_pb2.StatsRequest())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await client.generate(stub, client.generate_request("", "counted", 2), KEY_OF["globex"])
    own = await stub.Stats(scheduler_pb2.StatsRequest(), metadata=client.metadata(KEY_OF["globex"]))
    assert [t.tenant for t in own.tenants] == ["globex"] and not own.executors
    assert own.tenants[0].requests >= 1


async def test_base_model_request_and_stop_string(fleet, pushed, stub, tiny, hf_peft):
    tokenizer = Tokenizer.from_file(f"{tiny['model_dir']}/tokenizer.json")
    prompt = "many adapters serve the batch"
    expected, _ = hf_greedy(hf_peft, tokenizer.encode(prompt).ids, 10)
    full = await client.generate(stub, client.generate_request("", prompt, 10, ignore_eos=True),
                                 KEY_OF["acme"])
    assert full.token_ids == expected
    stop = full.text[len(full.text) // 2:][:3]
    cut = await client.generate(stub, client.generate_request("", prompt, 10, stop=[stop],
                                                              ignore_eos=True), KEY_OF["acme"])
    assert cut.finish_reason == "FINISH_REASON_STOP"
    assert cut.text == full.text[:full.text.find(stop)]


async def _status(stub, request, api_key=KEY_OF["acme"]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.generate(stub, request, api_key)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("case, request_kw, api_key, code, words", [
    ("unknown adapter", dict(adapter="no-such-adapter"), KEY_OF["acme"], grpc.StatusCode.NOT_FOUND,
     "no-such-adapter"),
    ("another tenant's", dict(adapter="r32_all"), KEY_OF["acme"], grpc.StatusCode.NOT_FOUND,
     "r32_all"),
    ("other base model", dict(adapter="other_base"), KEY_OF["acme"],
     grpc.StatusCode.FAILED_PRECONDITION, "other-org/other-base-model"),
    ("rank above max", dict(adapter="r64"), KEY_OF["acme"], grpc.StatusCode.INVALID_ARGUMENT,
     "rank 64"),
    ("bad adapter ref", dict(adapter="a b@c"), KEY_OF["acme"], grpc.StatusCode.INVALID_ARGUMENT,
     "name@"),
    ("prompt too long", dict(prompt=[5] * 2040, max_new_tokens=16), KEY_OF["acme"],
     grpc.StatusCode.INVALID_ARGUMENT, "over the context of 2048 tokens"),
    ("token outside vocab", dict(prompt=[5, 5000]), KEY_OF["acme"],
     grpc.StatusCode.INVALID_ARGUMENT, "5000"),
    ("empty prompt", dict(prompt=""), KEY_OF["acme"], grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("negative temperature", dict(temperature=-1.0), KEY_OF["acme"],
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("nan temperature", dict(temperature=math.nan), KEY_OF["acme"],
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("top_p above 1", dict(top_p=2.0), KEY_OF["acme"], grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("top_k above vocab", dict(top_k=10**6), KEY_OF["acme"], grpc.StatusCode.INVALID_ARGUMENT,
     "top_k"),
    ("no api key", dict(), "", grpc.StatusCode.UNAUTHENTICATED, "API key"),
    ("wrong api key", dict(), "nope", grpc.StatusCode.UNAUTHENTICATED, "API key"),
])
async def test_bad_generate_requests(fleet, pushed, stub, case, request_kw, api_key, code, words):
    kw = dict(prompt="hello there", max_new_tokens=4) | request_kw
    got_code, details = await _status(stub, client.generate_request(**kw), api_key)
    assert got_code == code, f"{case}: {details}"
    assert words in details, f"{case}: {details}"
    ok = await client.generate(stub, client.generate_request("r4_attn", "still serving", 3),
                               KEY_OF["acme"])
    assert len(ok.token_ids) >= 1


@pytest.mark.parametrize("fixture_name, words",
                         [("truncated", "safetensors"), ("pickle", "safetensors")])
async def test_bad_adapter_files_are_refused_at_push(fleet, tiny, fixture_name, words):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.push_adapter(fleet.stores[0], tiny["adapters"][fixture_name]["path"],
                                  fixture_name, key=fleet.keys.admin)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


async def test_cancel_frees_blocks_and_pins(fleet, pushed, stub):
    call = stub.Generate(client.generate_request("r16_all", "cancel me soon", 500, ignore_eos=True),
                         metadata=client.metadata(KEY_OF["acme"]))
    seen = 0
    async for _ in call:
        seen += 1
        if seen == 3:
            break
    call.cancel()
    for _ in range(100):  # (its slot stays pinned until the steps in flight with it are answered)
        (ex,) = (await stub.Stats(scheduler_pb2.StatsRequest(),
                                  metadata=client.metadata(fleet.keys.admin))).executors
        if ex.running == 0 and all(slot.pins == 0 for slot in ex.slots):
            break
        await asyncio.sleep(0.05)
    assert ex.running == 0 and ex.free_kv_blocks + ex.adapter_pages == KV_BLOCKS
    assert all(slot.pins == 0 for slot in ex.slots)


async def test_rate_limit_is_resource_exhausted_with_retry_after(fleet, pushed, stub):
    ok = await client.generate(stub, client.generate_request("r4_attn", "first one", 2),
                               KEY_OF["limited"])
    assert len(ok.token_ids) >= 1
    call = stub.Generate(client.generate_request("r4_attn", "too soon", 2),
                         metadata=client.metadata(KEY_OF["limited"]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after = float(dict(info.value.trailing_metadata())["retry-after"])
    assert 0 < retry_after <= 50.0  # (one request per 50 s)
    await client.generate(stub, client.generate_request("r4_attn", "other tenants pass", 2),
                          KEY_OF["acme"])


async def test_timings_of_every_step_and_load_fit_the_cost_model(fleet, pushed, log_dir):
    """--timings-out logged the steps and loads of the traffic above; fit-cost reads them."""
    lines = (log_dir / "timings.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = [r for r in records if "step" in r]
    loads = [r for r in records if "load" in r]
    executor = fleet.by_name("executor")[0].address
    assert steps and all(r["step"] == executor and 0 < r["tokens"]
                         and 0 <= r["adapters"] <= NUM_SLOTS and r["seconds"] > 0 for r in steps)
    # ten adapters through six slots: some were evicted and loaded again
    assert len(loads) > NUM_SLOTS
    assert all(r["bytes"] in {info.num_bytes for info in pushed.values()} and r["seconds"] > 0
               for r in loads)
    fit = fit_cost(lines)
    assert (fit.num_steps, fit.num_loads) == (len(steps), len(loads))
    assert fit.cost.step_per_token_s > 0 and fit.cost.load_bytes_per_s > 0
