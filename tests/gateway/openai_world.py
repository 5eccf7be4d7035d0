"""What the OpenAI gateway tests share (their world is tests/gateway/conftest.py): the tenants'
keys, the models and adapters they push, and clients of the gateway and of a pool."""

import secrets

import openai

from common.server import insecure_channel
from loraplex import client
from loraplex.demo import MODEL_DIR as DEMO_MODEL_DIR
from protos import scheduler_pb2_grpc

DEMO_MODEL = "loraplex-demo-tiny"
DEMO_ADAPTERS = DEMO_MODEL_DIR.parent / "adapters"
KEYS = {"acme": secrets.token_hex(16), "globex": secrets.token_hex(16),
        "limited": secrets.token_hex(16)}
EXECUTOR = ["--adapter-slots", "2", "--threads", "1"]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a river."}]


def openai_client(world, tenant: str = "acme") -> openai.AsyncOpenAI:
    http = world["gateway"].announced["gateway-http"]
    return openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key=KEYS[tenant],
                              max_retries=0, timeout=120)


async def direct(world, pool: str, adapter: str, prompt, max_new: int, tenant="acme") -> str:
    """What the pool's own scheduler answers (greedy)."""
    async with insecure_channel(world[pool].scheduler) as channel:
        out = await client.generate(scheduler_pb2_grpc.SchedulerStub(channel),
                                    client.generate_request(adapter, prompt, max_new),
                                    KEYS[tenant])
    return out.text
