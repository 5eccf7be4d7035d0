"""Aliases through the real services: two store replicas on SeaweedFS, an executor and the
scheduler as separate processes. Moving `prod` while requests stream: running sequences keep the
version they resolved, new requests get the new version at once (through the other replica)."""

import asyncio

import pytest

from common.server import insecure_channel
from loraplex import client
from loraplex.launch import Fleet, FleetKeys
from protos import adapter_store_pb2 as pb
from protos import scheduler_pb2_grpc
from tests.conftest import API_KEYS

KEY = next(key for key, tenant in API_KEYS.items() if tenant == "acme")
PROMPTS = ["the model serves many adapters", "tokens stream quickly", "a batch of tokens",
           "many adapters serve the batch"]
NUM_TOKENS = 64
RESOLVE_TTL_S = 0.2  # the scheduler sees a moved alias this long after the move


@pytest.fixture(scope="module")
def fleet(tiny, seaweedfs_s3, log_dir):
    fleet = Fleet(model=tiny["model_dir"], store_url=f"s3://{seaweedfs_s3.bucket}/alias-fleet",
                  log_dir=log_dir / "alias-fleet", num_stores=2,
                  store_args=["--s3-endpoint-url", seaweedfs_s3.endpoint_url],
                  executor_args=["--adapter-slots", "4", "--max-rank", "32", "--kv-blocks", "128",
                                 "--block-size", "8", "--threads", "1"],
                  keys=FleetKeys(tenants=API_KEYS),
                  scheduler_args=["--resolve-ttl-s", str(RESOLVE_TTL_S)])
    with fleet:
        yield fleet


async def test_alias_moved_while_requests_run(fleet, tiny):
    first, second = fleet.stores
    for fixture in ("r8_mlp", "r16_all"):  # bot@1, bot@2
        await client.push_adapter(first, tiny["adapters"][fixture]["path"], "bot", key=KEY)
    await client.store_call(first, "SetAlias", pb.SetAliasRequest(
        name="bot", alias="prod", version=1), key=KEY)

    async with insecure_channel(fleet.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        def request(adapter: str, prompt: str) -> object:
            return client.generate_request(adapter, prompt, NUM_TOKENS, ignore_eos=True)

        # Reference outputs of each exact version.
        expected = {(ref, p): (await client.generate(stub, request(f"bot@{ref}", p), KEY)).token_ids
                    for ref in (1, 2) for p in PROMPTS}
        assert all(expected[(1, p)] != expected[(2, p)] for p in PROMPTS)

        # From the moment every stream has its first token until the alias has moved, the
        # executor is frozen: the move lands mid-stream however fast this machine runs them.
        (executor,) = fleet.by_name("executor")
        started = asyncio.Event()
        num_started = [0]

        async def running(prompt: str) -> client.Generation:
            out = client.Generation()
            async for response in client.stream(stub, request("bot@prod", prompt), KEY):
                if response.HasField("token_id"):
                    out.token_ids.append(response.token_id)
                    if len(out.token_ids) == 1:
                        num_started[0] += 1
                        if num_started[0] == len(PROMPTS):
                            executor.freeze()
                            started.set()
                out.usage = response.usage if response.finish_reason else out.usage
            return out

        before = [asyncio.create_task(running(p)) for p in PROMPTS]
        try:
            await asyncio.wait_for(started.wait(), 60)
            # Every stream has its first token; move the alias through the *other* replica.
            moved = await client.store_call(second, "SetAlias", pb.SetAliasRequest(
                name="bot", alias="prod", version=2), key=KEY)
            assert moved.previous_version == 1
            assert not all(task.done() for task in before)  # the move landed mid-stream
        finally:
            executor.thaw()
        await asyncio.sleep(RESOLVE_TTL_S)  # the scheduler's answer for bot@prod expires
        after = await asyncio.gather(*(client.generate(stub, request("bot@prod", p), KEY)
                                       for p in PROMPTS))
        before = await asyncio.gather(*before)

    for prompt, old, new in zip(PROMPTS, before, after):
        assert client.ref_text(old.usage.adapter) == "bot@1"
        assert client.ref_text(new.usage.adapter) == "bot@2"
        assert old.token_ids == expected[(1, prompt)] and new.token_ids == expected[(2, prompt)]
