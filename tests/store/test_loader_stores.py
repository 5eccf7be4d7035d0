"""An executor's loader over several store replicas: one that is frozen (accepts the call, sends
nothing) costs a fetch its first-answer bound once, then is tried last."""

import asyncio

import grpc
import pytest

from common.adapter_ref import AdapterRef
from executor.adapter_loader import AdapterLoader
from loraplex.fixtures import MODEL_ID
from protos import adapter_store_pb2_grpc
from tests.store.helpers import lora_config, make_adapter

CONFIG_JSON = lora_config(base_model_name_or_path=MODEL_ID)


class FrozenStore(adapter_store_pb2_grpc.AdapterStoreServicer):
    """A store replica that takes Fetch calls and never answers them."""

    def __init__(self):
        self.fetches = 0

    async def Fetch(self, request, context):
        self.fetches += 1
        await asyncio.Event().wait()
        yield  # (never reached: makes this a streaming handler)


@pytest.fixture
async def frozen():
    servicer = FrozenStore()
    server = grpc.aio.server()
    adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(grace=0)


async def test_a_frozen_store_is_passed_over_then_tried_last(frozen, file_store, runner):
    servicer, frozen_address = frozen
    _, data = make_adapter(seed=3)
    for name in ("first", "second"):
        await file_store.push(name, CONFIG_JSON, data)
    loader = AdapterLoader(runner, (frozen_address, file_store.running.address),
                           holder="test-frozen-store", first_answer_s=0.5)
    try:
        first = await loader.load(AdapterRef("first", 1), slot=0, timeout_s=60)
        assert first.num_bytes == len(data) and servicer.fetches == 1
        second = await loader.load(AdapterRef("second", 1), slot=1, timeout_s=60)
        assert second.num_bytes == len(data) and servicer.fetches == 1  # not asked again
        assert loader.slot_adapters == [AdapterRef("first", 1), AdapterRef("second", 1)]
    finally:
        for slot in (0, 1):
            await loader.unload(slot)
        await loader.close()
