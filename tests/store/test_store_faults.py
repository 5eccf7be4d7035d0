"""Faults on the S3 -> host -> slot path, against real SeaweedFS: a corrupted object is DATA_LOSS
after retries and never reaches a slot; S3 killed in the middle of a (multi-part) load gives
UNAVAILABLE and the store recovers when S3 is back; 100 concurrent fetches of a cold multi-part
adapter cause one read."""

import asyncio
import uuid

import grpc
import pytest
import safetensors.torch

from adapter_store.config import StoreConfig
from common.adapter_ref import AdapterRef
from common.errors import DataLoss, Unavailable
from executor.adapter_loader import AdapterLoader
from executor.runner import ModelRunner
from loraplex.fixtures import MODEL_ID
from protos import adapter_store_pb2 as pb
from tests.s3server import SeaweedS3, seaweed_or_skip
from tests.store.helpers import (
    Store,
    expect_error,
    in_session_loop,
    lora_config,
    lora_tensors,
    pages_for,
    weights_key,
)

BIG_REF = AdapterRef("big", 1)

PART = 64 * 1024
# Attention-only LoRA fits the tiny fixture model (hidden 256, 2 kv heads of 64): ~0.9 MB, 15 parts.
CONFIG_JSON = lora_config(rank=64, base_model_name_or_path=MODEL_ID)
DATA = safetensors.torch.save(lora_tensors(rank=64, num_layers=4, seed=11))


def big_pages(runner) -> tuple[int, ...]:
    return pages_for(runner, CONFIG_JSON, DATA)


@pytest.fixture(scope="module")
def own_s3():
    """A SeaweedFS of this module's own, which the tests kill and restart."""
    yield from seaweed_or_skip()


async def start_store(s3: SeaweedS3, **overrides) -> Store:
    config = StoreConfig(url=f"s3://{s3.bucket}/{uuid.uuid4().hex}", chunk_bytes=PART,
                         s3_endpoint_url=s3.endpoint_url, s3_part_bytes=PART, **overrides)
    store = await Store(config).start()
    await store.push("big", CONFIG_JSON, DATA, chunk=256 * 1024)
    return store


def count_s3_gets(store: Store, on_get=None) -> list[int]:
    """Count (and optionally intercept) the GetObject calls of the store's S3 client."""
    client = store.blobs.inner._client
    original, calls = client.get_object, [0]

    async def get_object(**kw):
        calls[0] += 1
        if on_get is not None:
            on_get(calls[0])
        return await original(**kw)

    client.get_object = get_object
    return calls


def slot_is_empty(runner: ModelRunner, slot: int) -> bool:
    return not runner.pool.contents(slot).targets and not runner.pool.contents(slot).pages


@in_session_loop
async def test_corrupted_object_is_data_loss_after_retries_and_never_reaches_a_slot(own_s3,
                                                                                     runner):
    store = await start_store(own_s3, read_attempts=3)
    loader = AdapterLoader(runner, (store.running.address,), holder="test-corrupt")
    try:
        key = store.config.s3_prefix + weights_key("big", DATA)
        corrupted = bytearray(DATA)
        corrupted[len(DATA) // 2] ^= 0x01  # one flipped bit in a middle part
        own_s3.client().put_object(Bucket=own_s3.bucket, Key=key, Body=bytes(corrupted))
        with pytest.raises(DataLoss, match="sha256"):
            await loader.load(BIG_REF, 0, big_pages(runner))
        assert loader.slot_adapters == [None, None] and slot_is_empty(runner, 0)
        stats = await store.stub.Stats(pb.StoreStatsRequest())
        assert (stats.checksum_failures, stats.host_entries) == (3, 0)  # re-read, never cached
        own_s3.client().put_object(Bucket=own_s3.bucket, Key=key, Body=DATA)  # repaired
        result = await loader.load(BIG_REF, 0, big_pages(runner))
        assert not result.was_resident and result.num_bytes == len(DATA)
        assert loader.slot_adapters[0] == BIG_REF and not slot_is_empty(runner, 0)
    finally:
        await loader.unload(0)
        await loader.close()
        await store.stop()


@in_session_loop
async def test_s3_killed_mid_load_is_unavailable_and_recovers(own_s3, runner):
    store = await start_store(own_s3)
    loader = AdapterLoader(runner, (store.running.address,), holder="test-kill")

    def kill_after_first_part(num_calls: int) -> None:
        if num_calls == 2:  # the first ranged GET went through; the rest find S3 gone
            own_s3.kill()

    calls = count_s3_gets(store, kill_after_first_part)
    try:
        with pytest.raises(Unavailable, match="S3"):
            await loader.load(BIG_REF, 1, big_pages(runner))
        assert calls[0] >= 2 and loader.slot_adapters[1] is None and slot_is_empty(runner, 1)
        details = await expect_error(grpc.StatusCode.UNAVAILABLE, store.fetch("big", 1))
        assert "S3" in details
        own_s3.restart()
        result = await loader.load(BIG_REF, 1, big_pages(runner))  # same store process, S3 back
        assert result.num_bytes == len(DATA) and loader.slot_adapters[1] == BIG_REF
        assert (await store.fetch("big", 1))[1] == DATA
    finally:
        if own_s3.process.poll() is not None:
            own_s3.restart()
        await loader.unload(1)
        await loader.close()
        await store.stop()


@in_session_loop
async def test_single_flight_of_100_fetches_of_a_cold_multipart_adapter(own_s3):
    store = await start_store(own_s3)
    try:
        calls = count_s3_gets(store)
        store.blobs.gate = asyncio.Event()  # the one read waits until all 100 requests are in
        fetches = [asyncio.ensure_future(store.fetch("big", 1)) for _ in range(100)]
        for _ in range(500):
            if (await store.stub.Stats(pb.StoreStatsRequest())).fetches == 100:
                break
            await asyncio.sleep(0.01)
        store.blobs.gate.set()
        results = await asyncio.gather(*fetches)
        assert all(data == DATA for _, data in results)
        stats = await store.stub.Stats(pb.StoreStatsRequest())
        assert (stats.blob_reads, stats.host_misses, stats.host_joined) == (1, 1, 99)
        assert calls[0] == -(-len(DATA) // PART)  # one whole read = one ranged GET per part
    finally:
        await store.stop()


@in_session_loop
async def delete_once_certain(store: Store, request: pb.DeleteAdapterRequest):
    """DeleteAdapter, asked again while the store answers UNAVAILABLE: its lease writes are in
    doubt (one still in flight, or one failed within a lease TTL, e.g. right after this module's
    S3 restart), as a client asked to "retry later" would."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            return await store.stub.DeleteAdapter(request)
        except grpc.aio.AioRpcError as err:
            if (err.code() != grpc.StatusCode.UNAVAILABLE
                    or asyncio.get_running_loop().time() > deadline):
                raise
        await asyncio.sleep(0.1)


async def test_executor_reports_residency_and_pins_against_delete(own_s3, runner):
    store = await start_store(own_s3, lease_ttl_s=5)
    loader = AdapterLoader(runner, (store.running.address,), holder="gpu-test")
    try:
        await loader.load(BIG_REF, 0, big_pages(runner))
        assert await loader.report_residency()
        delete = pb.DeleteAdapterRequest(name="big", version=1)
        details = await expect_error(grpc.StatusCode.FAILED_PRECONDITION,
                                     delete_once_certain(store, delete))
        assert "resident on gpu-test" in details
        lease = f"{store.config.s3_prefix}leases/gpu-test.json"  # the durable copy, written
        assert own_s3.client().list_objects_v2(Bucket=own_s3.bucket, Prefix=lease)["KeyCount"]
        await loader.unload(0)
        assert await loader.report_residency()
        assert list((await delete_once_certain(store, delete)).versions) == [1]
        assert not runner.pool.contents(0).pages
    finally:
        await loader.close()
        await store.stop()
