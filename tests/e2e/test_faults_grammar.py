"""A grammar's state survives what the scheduler does to a sequence, with real processes: an
executor frozen mid-generation (its sequences recomputed on the other from prompt + the tokens
streamed so far) and KV preemption (recomputed later) both leave every constrained, seeded
stream with exactly the tokens of a fault-free run, each a JSON value valid against its
schema."""

import asyncio
import json

import jsonschema
import pytest

from common.grammar import Grammar, GrammarKind
from common.server import insecure_channel
from loraplex import client
from loraplex.launch import Fleet
from protos import scheduler_pb2_grpc
from tests.e2e.test_faults_executor import FAST_FAILOVER, with_the_busiest_frozen

ADAPTERS = ("r4_attn", "r8_mlp", "r16_all", "")
SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"word": {"enum": ["stone", "river", "quiet cloud"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 6}},
                         "ok": {"type": "boolean"}},
          "required": ["word", "count", "tags", "ok"]}
GRAMMAR = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)).to_pb()


def requests(n: int = 12, adapters=ADAPTERS, max_new: int = 200):
    out = []
    for i in range(n):
        request = client.generate_request(adapters[i % len(adapters)], f"record {i}:", max_new,
                                          temperature=1.0, seed=500 + i)
        request.sampling.grammar.CopyFrom(GRAMMAR)
        out.append(request)
    return out


def check(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def fleet(tiny, tmp_path_factory, log_dir):
    with Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("store").as_uri(),
               log_dir=log_dir / "faults-grammar", num_executors=2,
               executor_args=["--adapter-slots", "4", "--threads", "1"],
               scheduler_args=FAST_FAILOVER) as fleet:
        yield fleet


async def test_a_frozen_executors_constrained_streams_go_on_in_their_grammar(fleet, tiny):
    for name in ADAPTERS[:-1]:
        await client.push_adapter(fleet.stores[0], tiny["adapters"][name]["path"], name)
    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        expected = [(await client.generate(stub, r)).token_ids for r in requests()]
        first_tokens, started = asyncio.Event(), [0]

        async def run(request) -> tuple[list[int], str]:
            tokens, text = [], ""
            async for response in client.stream(stub, request):
                text += response.text
                if response.HasField("token_id"):
                    tokens.append(response.token_id)
                    if len(tokens) == 3:
                        started[0] += 1
                        if started[0] == len(expected):
                            first_tokens.set()
            return tokens, text

        calls = [asyncio.create_task(run(r)) for r in requests()]
        await asyncio.wait_for(first_tokens.wait(), 60)
        got, _ = await with_the_busiest_frozen(fleet, stub, calls)
    assert [tokens for tokens, _ in got] == expected
    for _, text in got:
        check(text)


@pytest.fixture(scope="module")
def small_kv_fleet(tiny, tmp_path_factory, log_dir):
    """KV for about two sequences at a time: more in flight are preempted and recomputed."""
    with Fleet(model=tiny["model_dir"], store_url=tmp_path_factory.mktemp("kv-store").as_uri(),
               log_dir=log_dir / "faults-grammar-kv",
               executor_args=["--kv-blocks", "16", "--block-size", "8", "--threads", "1"]) as f:
        yield f


async def test_constrained_streams_are_the_same_across_preemption(small_kv_fleet):
    request = requests(1, ("",), max_new=100)[0]  # (within the 128 tokens of KV)
    async with insecure_channel(small_kv_fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        alone = await client.generate(stub, request)
        crowd = await asyncio.gather(*(client.generate(stub, request) for _ in range(6)))
    check(alone.text)
    assert all(c.token_ids == alone.token_ids for c in crowd)
