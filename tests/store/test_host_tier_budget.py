"""The host-RAM tier's budget holds while reads fill it: bytes being read from the blob store count
against it (reserved when the read starts), so concurrent fills larger in sum than the budget wait
for room (bounded), or are read through and not kept, and every fill serves the right bytes."""

import asyncio
import hashlib

from adapter_store.blobs import BlobStore
from adapter_store.host_cache import RESTART, HostCache
from adapter_store.records import AdapterRecord
from common.errors import NotFound

NUM_PARTS = 8  # each object arrives in this many parts, a short sleep between two


class SlowBlobs(BlobStore):
    """Objects in memory, handed out in parts with a pause between them (reads overlap), and
    `on_part()` called as each part is taken (the test measures the tier there)."""

    description = "memory://slow"

    def __init__(self, objects: dict[str, bytes], on_part):
        self.objects = objects
        self.on_part = on_part

    async def iter_parts(self, key):
        data = self.objects[key]
        step = -(-len(data) // NUM_PARTS)
        for begin in range(0, len(data), step):
            await asyncio.sleep(0.002)
            self.on_part()
            yield data[begin:begin + step]

    async def get_with_etag(self, key):
        if key not in self.objects:
            raise NotFound(key)
        return self.objects[key], "etag"

    async def put(self, key, data, **conditions):
        self.objects[key] = data

    async def delete(self, key):
        self.objects.pop(key, None)

    async def list_objects(self, prefix):
        return {k: "etag" for k in self.objects if k.startswith(prefix)}


def record(name: str, data: bytes) -> AdapterRecord:
    return AdapterRecord(
        name=name, version=1, owner_tenant="", is_public=True, base_model="tiny", rank=8,
        alpha=16.0, use_rslora=False, target_modules=("q_proj",), num_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(), created_unix=0.0, config_json="{}",
        weights_key=f"adapters/{name}/weights/{hashlib.sha256(data).hexdigest()}.safetensors")


def held_bytes(cache: HostCache) -> int:
    """What the tier holds in RAM: its entries, and what its reads in flight received so far."""
    in_flight = sum(len(part) for flight in cache._in_flight.values() for part in flight.parts)
    return cache.num_bytes + in_flight


async def read(cache: HostCache, rec: AdapterRecord) -> bytes:
    parts = []
    async for part in cache.stream(rec):
        if part is RESTART:
            parts.clear()
        else:
            parts.append(part)
    return b"".join(parts)


async def test_concurrent_fills_larger_than_the_budget_never_hold_more_than_it():
    size = 64 * 1024
    adapters = {f"bot-{i}": bytes([i]) * size for i in range(8)}  # 8 adapters, 4 fit
    records = [record(name, data) for name, data in adapters.items()]
    peaks = {"held": 0, "accounted": 0}

    def measure() -> None:
        peaks["held"] = max(peaks["held"], held_bytes(cache))
        peaks["accounted"] = max(peaks["accounted"], cache.num_bytes + cache.reserved_bytes)

    blobs = SlowBlobs({r.weights_key: adapters[r.name] for r in records}, measure)
    capacity = 4 * size + size // 2
    cache = HostCache(blobs, capacity, piece_bytes=16 * 1024, fill_wait_s=30.0)
    # Every adapter twice at once (one read each, single-flight), and some warmed besides.
    reads = [read(cache, r) for r in records for _ in range(2)]
    warms = [cache.warm(r) for r in records[::3]]
    results = await asyncio.gather(*reads, *warms)
    assert results[:len(reads)] == [adapters[r.name] for r in records for _ in range(2)]
    assert peaks["held"] <= capacity, f"the tier held {peaks['held']} bytes, over {capacity}"
    assert peaks["accounted"] <= capacity
    assert cache.reserved_bytes == 0 and cache.num_bytes <= capacity
    assert len(cache) == 4 and cache.stats.blob_reads == len(records)
    assert cache.stats.read_through == 0  # each waited for room within fill_wait_s


async def test_a_fill_that_finds_no_room_in_time_is_read_through_and_not_kept():
    size = 64 * 1024
    first, second = record("first", b"\1" * size), record("second", b"\2" * size)
    gate = asyncio.Event()

    class GatedBlobs(SlowBlobs):
        async def iter_parts(self, key):
            if key == first.weights_key:
                await gate.wait()  # the first read holds the whole budget until released
            async for part in super().iter_parts(key):
                yield part

    blobs = GatedBlobs({first.weights_key: b"\1" * size, second.weights_key: b"\2" * size},
                       lambda: None)
    cache = HostCache(blobs, size + size // 2, piece_bytes=16 * 1024, fill_wait_s=0.2)
    held = asyncio.ensure_future(read(cache, first))
    await asyncio.sleep(0.05)
    assert cache.reserved_bytes == size
    assert await asyncio.wait_for(read(cache, second), 5.0) == b"\2" * size
    assert second not in cache and cache.stats.read_through == 1
    gate.set()
    assert await held == b"\1" * size and first in cache
    assert cache.reserved_bytes == 0 and cache.num_bytes == size
    assert await read(cache, second) == b"\2" * size  # room now: this read is kept
    assert second in cache and first not in cache  # (the LRU one made room)
