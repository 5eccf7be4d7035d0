"""An executor's loader over several store replicas: one that is frozen (accepts the call, sends
nothing) costs a fetch its first-answer bound once, then is tried last; one that freezes
mid-stream (a real store process, SIGSTOPped after its first chunk) costs it one chunk timeout,
and the next replica sends the adapter whole."""

import asyncio
import concurrent.futures
import time

import grpc
import pytest
import safetensors.torch

from common.adapter_ref import AdapterRef
from common.server import insecure_channel
from executor.adapter_loader import AdapterLoader
from executor.lora.slot_copy import StagingBuffers
from executor.store_fetch import StoreFetcher
from loraplex import client
from loraplex.fixtures import MODEL_ID
from loraplex.launch import ServiceProcess, start_service
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc
from tests.store.helpers import (
    SHAPES,
    WEIGHTS,
    lora_config,
    lora_tensors,
    make_adapter,
    pages_for,
)

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
        first = await loader.load(AdapterRef("first", 1), 0, pages_for(runner, CONFIG_JSON, data),
                                  timeout_s=60)
        assert first.num_bytes == len(data) and servicer.fetches == 1
        second = await loader.load(AdapterRef("second", 1), 1, pages_for(runner, CONFIG_JSON, data),
                                   timeout_s=60)
        assert second.num_bytes == len(data) and servicer.fetches == 1  # not asked again
        assert loader.slot_adapters == [AdapterRef("first", 1), AdapterRef("second", 1)]
    finally:
        for slot in (0, 1):
            await loader.unload(slot)
        await loader.close()


CHUNK_TIMEOUT_S = 1.0
SLACK_S = 3.0  # a loaded 2-core machine: the second replica's whole send, and scheduling


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, log_dir):
    """Two store processes over one registry (local files), sending 64 KiB chunks."""
    url = (tmp_path_factory.mktemp("replicas") / "store").as_uri()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda i: start_service(
            f"store-replica-{i}", "adapter_store.service",
            ["--url", url, "--chunk-bytes", str(64 * 1024), "--host-cache-mb", "0"],
            log_dir / "loader-stores"), range(2)))
    yield started
    for replica in started:
        replica.stop(grace=2)


class FreezeAfterFirstChunk:
    """A store stub whose Fetch SIGSTOPs the store's process once its first chunk arrived, and
    counts the chunk bytes that still came (those the transport held)."""

    def __init__(self, stub: adapter_store_pb2_grpc.AdapterStoreStub, process: ServiceProcess):
        self._stub, self._process = stub, process
        self.num_bytes = 0

    def Fetch(self, request, **kwargs):
        return _Freezing(self, self._stub.Fetch(request, **kwargs))


class _Freezing:
    def __init__(self, stub: FreezeAfterFirstChunk, call):
        self._stub, self._call = stub, call

    def cancel(self) -> bool:
        return self._call.cancel()

    async def __aiter__(self):
        async for msg in self._call:
            if msg.WhichOneof("payload") == "chunk":
                if not self._stub.num_bytes:
                    self._stub._process.freeze()
                self._stub.num_bytes += len(msg.chunk)
            yield msg


async def test_a_store_frozen_mid_fetch_costs_one_chunk_timeout(replicas):
    first, second = replicas
    tensors = lora_tensors(targets=tuple(SHAPES), rank=64, num_layers=8, seed=5)
    data = safetensors.torch.save(tensors)  # 8 MiB: 128 chunks, far more than the transport holds
    async with insecure_channel(first.address) as first_channel, \
            insecure_channel(second.address) as second_channel:
        header = pb.PushHeader(name="big", config_json=lora_config(tuple(SHAPES), rank=64),
                               weights_filename=WEIGHTS, num_bytes=len(data))
        await client.push(adapter_store_pb2_grpc.AdapterStoreStub(first_channel), header, data)
        freezing = FreezeAfterFirstChunk(adapter_store_pb2_grpc.AdapterStoreStub(first_channel),
                                         first)
        fetcher = StoreFetcher(
            [(first.address, freezing),
             (second.address, adapter_store_pb2_grpc.AdapterStoreStub(second_channel))],
            StagingBuffers(pin_memory=False), lambda key, info, buffer: bytes(buffer.numpy()),
            chunk_timeout_s=CHUNK_TIMEOUT_S)
        start = time.perf_counter()
        try:
            _, num_bytes, fetched = await fetcher.fetch(AdapterRef("big", 1), timeout_s=30)
        finally:
            first.thaw()
        seconds = time.perf_counter() - start
    assert 0 < freezing.num_bytes < len(data)  # the first replica froze mid-stream
    assert num_bytes == len(data) and fetched == data
    assert seconds < CHUNK_TIMEOUT_S + SLACK_S, f"the fetch took {seconds:.1f}s"
