"""The S3 requests behind a Fetch, counted at the store's S3 client. A cold Fetch of a version the
replica knows reads the weights and nothing else: one GET for an adapter of one part, one ranged
GET per part for a larger one; the manifest, immutable, is never read again. A replica that has
not seen the version yet reads it once (listing, manifest), then no more."""

import uuid

import safetensors.torch

from adapter_store.config import StoreConfig
from tests.store.helpers import Store, in_session_loop, lora_config, lora_tensors, weights_key

PART = 64 * 1024
SMALL = safetensors.torch.save(lora_tensors(rank=4, num_layers=2, seed=31))  # < one part
BIG = safetensors.torch.save(lora_tensors(rank=64, num_layers=4, seed=32))  # ~15 parts


def record_s3_requests(store: Store) -> list[tuple[str, str, str]]:
    """(method, key, Range) of every request the store sends to S3 from now on."""
    requests: list[tuple[str, str, str]] = []
    prefix = f"/{store.config.s3_bucket}/{store.config.s3_prefix}"

    def on_send(request, **_):
        path = request.url.split("?", 1)[0].split("://", 1)[1].split("/", 1)[1]
        key = ("/" + path).removeprefix(prefix) if ("/" + path).startswith(prefix) else path
        requests.append((request.method, key, request.headers.get("Range", b"").decode()))

    store.blobs.inner._client.meta.events.register("before-send.s3", on_send)
    return requests


async def start(s3, prefix: str) -> Store:
    return await Store(StoreConfig(url=f"s3://{s3.bucket}/{prefix}", chunk_bytes=PART,
                                   s3_endpoint_url=s3.endpoint_url, s3_part_bytes=PART,
                                   host_cache_bytes=0)).start()


@in_session_loop
async def test_a_cold_fetch_reads_only_the_weights(seaweedfs_s3):
    store = await start(seaweedfs_s3, uuid.uuid4().hex)
    try:
        await store.push("small", lora_config(rank=4), SMALL)
        await store.push("big", lora_config(rank=64), BIG, chunk=256 * 1024)
        requests = record_s3_requests(store)
        for _ in range(2):  # no host tier: every Fetch reads S3
            requests.clear()
            _, data = await store.fetch("small", 1)
            assert data == SMALL
            assert requests == [("GET", weights_key("small", SMALL), f"bytes=0-{PART - 1}")]
            requests.clear()
            _, data = await store.fetch("big", 1)
            assert data == BIG
            ranges = [f"bytes={b}-{min(b + PART, len(BIG)) - 1}" for b in range(0, len(BIG), PART)]
            assert len(ranges) > 10
            assert sorted(requests) == sorted(("GET", weights_key("big", BIG), r) for r in ranges)
    finally:
        await store.stop()


@in_session_loop
async def test_a_replica_reads_a_version_it_has_not_seen_once(seaweedfs_s3):
    prefix = uuid.uuid4().hex
    first, second = await start(seaweedfs_s3, prefix), await start(seaweedfs_s3, prefix)
    try:
        await first.push("small", lora_config(rank=4), SMALL)  # after `second` loaded its registry
        requests = record_s3_requests(second)
        _, data = await second.fetch("small", 1)
        assert data == SMALL
        weights = ("GET", weights_key("small", SMALL), f"bytes=0-{PART - 1}")
        listing = ("GET", seaweedfs_s3.bucket, "")  # ListObjectsV2 of adapters/small/
        manifest = ("GET", "adapters/small/v1/manifest.json", f"bytes=0-{PART - 1}")
        assert requests == [listing, manifest, weights]
        requests.clear()
        await second.fetch("small", 1)
        assert requests == [weights]
    finally:
        await first.stop()
        await second.stop()
