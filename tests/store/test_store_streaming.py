"""Streaming a cold adapter through the store while it is still being read: parts go out as they
arrive, the last part of a read waits for its sha256 check, a read that fails the check is
followed by RESTART and a good read, and the loader ends up with exactly the right weights
(also when its staging buffers are reused by adapters of other sizes). And stage before evict:
an adapter staged on the host (StageAdapter) loads without a fetch of its own."""

import asyncio
import contextlib
import dataclasses
import json
import threading

import pytest
import safetensors.torch
import torch

from adapter_store.blob_backends import open_blob_store
from adapter_store.host_cache import HEAD_PIECES, LAST_PIECE_BYTES, _PieceCutter
from adapter_store.records import MANIFEST_FILENAME, version_prefix
from adapter_store.service import start_store
from common.adapter_ref import AdapterRef
from common.errors import DataLoss
from common.server import insecure_channel
from executor.adapter_loader import AdapterLoader
from executor.lora.peft_adapter import parse_peft_adapter
from executor.lora.slot_copy import StagingBuffers
from executor.lora.staged import Staged, StagedAdapters
from loraplex.fixtures import MODEL_ID
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc, common_pb2
from tests.store.helpers import (
    CountingBlobStore,
    Store,
    file_config,
    in_session_loop,
    lora_config,
    lora_tensors,
    pages_for,
)

BIG_REF = AdapterRef("big", 1)

PART = 64 * 1024
CONFIG_JSON = lora_config(rank=64, base_model_name_or_path=MODEL_ID)
BIG = safetensors.torch.save(lora_tensors(rank=64, num_layers=4, seed=21))  # ~0.9 MB, 15 parts
SMALL_CONFIG_JSON = lora_config(rank=4, base_model_name_or_path=MODEL_ID)
SMALL = safetensors.torch.save(lora_tensors(rank=4, num_layers=4, seed=22))
HALF = safetensors.torch.save({k: v.to(torch.bfloat16)  # the pool (fp32) converts it
                               for k, v in lora_tensors(rank=4, num_layers=4, seed=23).items()})


def big_pages(runner) -> tuple[int, ...]:
    return pages_for(runner, CONFIG_JSON, BIG)


class PartedBlobStore(CountingBlobStore):
    """Hands an object on in PART-sized pieces; the first `num_bad_reads` reads have one flipped
    bit in their first part; a read waits at part `hold_at` until `release` is set."""

    def __init__(self, inner):
        super().__init__(inner)
        self.num_bad_reads = 0
        self.hold_at = -1
        self.release = asyncio.Event()
        self.num_parts_read = 0

    async def iter_parts(self, key):
        self.num_gets[key] += 1
        data = await self.inner.get(key)
        is_bad = self.num_bad_reads > 0
        self.num_bad_reads -= 1
        for index, offset in enumerate(range(0, len(data), PART)):
            if index == self.hold_at:
                await self.release.wait()
            part = bytearray(data[offset:offset + PART])
            if is_bad and index == 0:
                part[100] ^= 0x01
            self.num_parts_read += 1
            yield bytes(part)


class PartedStore(Store):
    async def start(self) -> "PartedStore":
        self.blobs = PartedBlobStore(await open_blob_store(self.config))
        self.running = await start_store(self.config, blobs=self.blobs)
        self.channel = insecure_channel(self.running.address)
        self.stub = adapter_store_pb2_grpc.AdapterStoreStub(self.channel)
        return self


@pytest.fixture
async def store(tmp_path):
    config = dataclasses.replace(file_config(tmp_path), chunk_bytes=PART, host_cache_bytes=0)
    store = await PartedStore(config).start()
    await store.push("big", CONFIG_JSON, BIG, chunk=256 * 1024)
    await store.push("small", SMALL_CONFIG_JSON, SMALL)
    await store.push("half", SMALL_CONFIG_JSON, HALF)
    yield store
    await store.stop()


async def payloads(store: PartedStore, name: str):
    """(kind, value) of every Fetch message."""
    request = pb.FetchRequest(adapter=common_pb2.AdapterRef(name=name, version=1))
    async for msg in store.stub.Fetch(request):
        kind = msg.WhichOneof("payload")
        yield kind, getattr(msg, kind)


@in_session_loop
async def test_cold_fetch_streams_before_the_read_ends_and_holds_the_last_part(store):
    store.blobs.hold_at = 5
    received = []
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(1.0):
                async for kind, value in payloads(store, "big"):
                    received.append((kind, value))
    finally:
        store.blobs.release.set()  # the read goes on; the next Fetch joins it from its start
    # info, then parts 0..3 (part 0 in HEAD_PIECES pieces): part 4 is the newest read and waits
    # for part 5 (or the check)
    assert [k for k, _ in received] == ["info"] + ["chunk"] * (HEAD_PIECES + 3)
    assert b"".join(v for _, v in received[1:]) == BIG[:4 * PART]
    assert b"".join([v async for k, v in payloads(store, "big") if k == "chunk"]) == BIG


@in_session_loop
async def test_a_read_that_fails_its_check_is_restarted_with_a_good_one(store):
    store.blobs.num_bad_reads = 1
    messages = [(k, v) async for k, v in payloads(store, "big")]
    kinds = [k for k, _ in messages]
    restart = kinds.index("restart")
    assert kinds[0] == "info" and kinds.count("restart") == 1
    before = b"".join(v for _, v in messages[1:restart])
    assert len(before) < len(BIG) and before != BIG[:len(before)]  # bad bytes, never the end
    assert b"".join(v for _, v in messages[restart + 1:]) == BIG
    stats = await store.stub.Stats(pb.StoreStatsRequest())
    assert (stats.blob_reads, stats.checksum_failures) == (2, 1)


@in_session_loop
async def test_loader_gets_the_right_weights_after_a_restart_and_with_reused_staging(store,
                                                                                      runner):
    loader = AdapterLoader(runner, (store.running.address,), holder="test-stream")
    adapters = {"big": (CONFIG_JSON, BIG), "small": (SMALL_CONFIG_JSON, SMALL),
                "half": (SMALL_CONFIG_JSON, HALF)}
    expected = {name: parse_peft_adapter(cfg, data, runner.config, max_rank=64)
                for name, (cfg, data) in adapters.items()}  # converted to fp32 by the parse
    try:
        store.blobs.num_bad_reads = 1
        for name, slot in [("big", 0), ("small", 1), ("small", 0), ("big", 1), ("half", 1),
                           ("big", 0), ("half", 0)]:
            await loader.unload(slot)
            result = await loader.load(AdapterRef(name, 1), slot,
                                       pages_for(runner, *adapters[name]))
            assert result.num_bytes == len(adapters[name][1])
            for (layer, module), weights in expected[name].modules.items():
                a, b = runner.pool.rows(layer, slot, module)
                assert torch.equal(a, weights.a) and torch.equal(b, weights.b)
    finally:
        for slot in (0, 1):
            await loader.unload(slot)
        await loader.close()


def damage(part: bytes, where: str) -> bytes:
    if where == "header":  # a header length past the end: the parse fails too
        return b"\xff" * 8 + part[8:]
    middle = len(part) // 2  # one flipped bit in a tensor value: the parse would accept it
    return part[:middle] + bytes([part[middle] ^ 0x10]) + part[middle + 1:]


@pytest.mark.parametrize("where", ["header", "value"])
@pytest.mark.parametrize("manifest", ["current", "without crc32"])
@in_session_loop
async def test_loader_checks_the_bytes_itself_before_the_parse_counts(tmp_path, runner, where,
                                                                      manifest):
    """A store that serves bad bytes past its own check (here: its RAM copy damaged after the
    check) gets DATA_LOSS at the executor, not the INVALID_ARGUMENT the parse of the damaged bytes
    (done beside the checksum) would give, nor a load of wrong weights; the slot is untouched.
    The executor checks the version's CRC-32, or sha256 for a version whose manifest was written
    before CRC-32s were recorded; the undamaged adapter then loads either way."""
    config = dataclasses.replace(file_config(tmp_path), chunk_bytes=PART)
    store = await PartedStore(config).start()
    await store.push("big", CONFIG_JSON, BIG, chunk=256 * 1024)
    if manifest == "without crc32":  # as written before the field existed; a new replica reads it
        key = version_prefix("big", 1) + MANIFEST_FILENAME
        old = json.loads(await store.blobs.get(key))
        del old["crc32"]
        await store.blobs.put(key, json.dumps(old).encode())
        await store.restart()
    info = await store.stub.GetAdapter(pb.GetAdapterRequest(name="big", version=1))
    assert info.HasField("crc32") == (manifest == "current")
    loader = AdapterLoader(runner, (store.running.address,), holder="test-own-check")
    try:
        await store.stub.Prewarm(pb.HostPrewarmRequest(name="big", version=1))
        entries = store.running.cache._entries
        intact = entries[BIG_REF]
        index = 0 if where == "header" else len(intact) // 2
        entries[BIG_REF] = (*intact[:index], damage(intact[index], where), *intact[index + 1:])
        await loader.unload(0)
        with pytest.raises(DataLoss, match="do not match the store's size"):
            await loader.load(BIG_REF, 0, big_pages(runner))
        assert not runner.pool.contents(0).targets and loader.slot_adapters[0] is None
        entries[BIG_REF] = intact
        assert not (await loader.load(BIG_REF, 0, big_pages(runner))).was_resident
        assert loader.slot_adapters[0] == BIG_REF
    finally:
        await loader.unload(0)
        await loader.close()
        await store.stop()


@pytest.mark.parametrize("num_bytes", [0, 1, LAST_PIECE_BYTES, LAST_PIECE_BYTES + 1,
                                       3 * PART - 7, 3 * PART, 5 * PART + LAST_PIECE_BYTES + 3])
def test_pieces_are_fetch_chunks_with_small_first_and_last_ones(num_bytes):
    data = bytes(range(256)) * (num_bytes // 256 + 1)
    data = data[:num_bytes]
    pieces: list[bytes] = []
    cutter = _PieceCutter(num_bytes, PART, pieces.append)
    for offset in range(0, num_bytes, 5000):  # parts of any size, split at any byte
        cutter.add(data[offset:offset + 5000])
    cutter.finish()
    assert b"".join(pieces) == data and all(isinstance(p, bytes) for p in pieces)
    assert all(0 < len(p) <= PART for p in pieces)
    if num_bytes:
        assert len(pieces[-1]) == min(num_bytes, LAST_PIECE_BYTES)
    body = pieces[:-2]  # up to the tail: the first chunk in HEAD_PIECES pieces, then full ones
    head = PART // HEAD_PIECES
    if num_bytes >= PART + LAST_PIECE_BYTES:
        assert [len(p) for p in body[:HEAD_PIECES]] == [head] * HEAD_PIECES
        assert all(len(p) == PART for p in body[HEAD_PIECES:])
    else:
        assert all(len(p) == head for p in body)


def test_staging_buffers_reuse_the_smallest_fitting_and_keep_the_largest():
    staging = StagingBuffers(pin_memory=False)
    buffers = [staging.take(n) for n in (100, 300, 200)]
    for buffer in buffers:
        staging.release(buffer)
    again = staging.take(150)
    assert again is buffers[2]  # 200 fits best; 100 was dropped (two kept)
    assert staging.take(250) is buffers[1] and staging.take(50).numel() == 50


@in_session_loop
async def test_a_load_cancelled_mid_copy_keeps_its_staging_and_slot_until_the_copy_ends(store,
                                                                                        runner):
    """The copy runs in a thread (on CUDA, queued on a side stream): a cancelled load must not
    hand its staging buffer to the next load, nor free the slot, while the copy still reads and
    writes them (the next load would then fill the same buffer or slot beside it)."""
    loader = AdapterLoader(runner, (store.running.address,), holder="test-cancel-copy")
    entered, release = threading.Event(), threading.Event()
    copy = loader._copier.copy

    def slow_copy(slot, weights, pages):
        entered.set()
        release.wait(10)
        copy(slot, weights, pages)

    loader._copier.copy = slow_copy
    try:
        await loader.unload(0)
        loading = asyncio.create_task(loader.load(BIG_REF, 0, big_pages(runner)))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        loading.cancel()
        await asyncio.sleep(0.2)
        assert not loading.done(), "the cancelled load waits for its copy"
        assert not loader._staging._free, "its staging buffer is not given back meanwhile"
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await loading
        assert loader._staging._free and loader.slot_adapters[0] is None
        loader._copier.copy = copy
        # the slot works as before
        assert not (await loader.load(BIG_REF, 0, big_pages(runner))).was_resident
    finally:
        release.set()
        await loader.unload(0)
        await loader.close()


# ---- stage before evict: StageAdapter fetches onto the host, the load only copies ----

async def fetches(store) -> int:
    return (await store.stub.Stats(pb.StoreStatsRequest())).fetches


@in_session_loop
async def test_a_staged_adapter_loads_without_a_fetch_and_stagings_share_one(store, runner):
    loader = AdapterLoader(runner, (store.running.address,), holder="test-staging")
    try:
        await loader.unload(0)
        before = await fetches(store)
        first, second = await asyncio.gather(loader.stage(BIG_REF), loader.stage(BIG_REF))
        assert first.num_bytes == second.num_bytes == len(BIG)
        assert await fetches(store) == before + 1, "two stagings, one fetch"
        assert loader.slot_adapters[0] is None, "staging touches no slot"
        assert (await loader.stage(BIG_REF)).was_resident, "staged already"
        result = await loader.load(BIG_REF, 0, big_pages(runner))
        assert not result.was_resident and await fetches(store) == before + 1
        expected = parse_peft_adapter(CONFIG_JSON, BIG, runner.config, max_rank=64)
        for (layer, module), weights in expected.modules.items():
            assert torch.equal(runner.pool.rows(layer, 0, module)[0], weights.a)
        assert loader.slot_adapters[0] == BIG_REF
        await loader.unload(0)
        await loader.load(BIG_REF, 0, big_pages(runner))  # the staged bytes were used up: fetched
        assert await fetches(store) == before + 2
    finally:
        await loader.unload(0)
        await loader.close()


def test_staged_adapters_are_bounded_by_bytes_and_age():
    released, now = [], [0.0]
    staged = StagedAdapters(released.append, max_bytes=100, ttl_s=10, clock=lambda: now[0])

    def entry(num_bytes: int) -> Staged:
        return Staged(torch.empty(num_bytes, dtype=torch.uint8), num_bytes, None, 0.0, now[0])

    a, b, c = AdapterRef("a", 1), AdapterRef("b", 1), AdapterRef("c", 1)
    staged.put(a, entry(60))
    staged.put(b, entry(30))
    staged.put(c, entry(50))  # over budget: the oldest (a) goes
    assert a not in staged and b in staged and c in staged and len(released) == 1
    now[0] = 11.0
    assert b not in staged and c not in staged, "too old"
    assert len(released) == 3
    staged.put(a, entry(10))
    taken = staged.take(a)
    assert taken is not None and a not in staged and len(released) == 3, "taken, not released"
    # A small adapter in a large reused buffer counts what it holds: the buffer.
    staged.put(b, Staged(torch.empty(80, dtype=torch.uint8), 5, None, 0.0, now[0]))
    staged.put(c, entry(30))
    assert b not in staged and c in staged and staged.num_bytes == 30
