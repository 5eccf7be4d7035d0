"""What the store tests share: tiny PEFT adapters, a started store with its stub, a blob store
that counts its reads, and calls that expect a status."""

import asyncio
import collections
import contextlib
import hashlib
import json
import uuid

import grpc
import pytest
import safetensors.torch
import torch

from adapter_store.blob_backends import open_blob_store
from adapter_store.blobs import BlobStore
from adapter_store.config import StoreConfig
from adapter_store.service import start_store
from common.server import insecure_channel
from executor.lora.peft_adapter import parse_peft_adapter
from loraplex import client
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc, common_pb2

# The store, its client and the fixtures share the session loop.
in_session_loop = pytest.mark.asyncio(loop_scope="session")

HIDDEN, KV, FFN = 256, 128, 512  # tiny LLaMA: 4 heads, 2 kv heads, head_dim 64
# module -> (block, in_features, out_features)
SHAPES = {"q_proj": ("self_attn", HIDDEN, HIDDEN), "k_proj": ("self_attn", HIDDEN, KV),
          "v_proj": ("self_attn", HIDDEN, KV), "o_proj": ("self_attn", HIDDEN, HIDDEN),
          "gate_proj": ("mlp", HIDDEN, FFN), "up_proj": ("mlp", HIDDEN, FFN),
          "down_proj": ("mlp", FFN, HIDDEN),
          # a fused layout's (Phi-3): B spans q | k | v, gate | up
          "qkv_proj": ("self_attn", HIDDEN, HIDDEN + 2 * KV),
          "gate_up_proj": ("mlp", HIDDEN, 2 * FFN)}
WEIGHTS = "adapter_model.safetensors"


def lora_tensors(targets=("q_proj", "v_proj"), rank=8, num_layers=2, seed=0,
                 ranks: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA weights; `ranks` overrides the rank of "layers.{i}.{module}" entries."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in targets:
            block, d_in, d_out = SHAPES[module]
            r = (ranks or {}).get(f"layers.{layer}.{module}", rank)
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, d_in, generator=gen)  # [r, in]
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, r, generator=gen)  # [out, r]
    return tensors


def lora_config(targets=("q_proj", "v_proj"), rank=8, **extra) -> str:
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(targets),
              "base_model_name_or_path": "tiny-llama", "use_rslora": False, **extra}
    return json.dumps(config)


def weights_key(name: str, data: bytes) -> str:
    """Where the registry keeps these weights (content-addressed)."""
    return f"adapters/{name}/weights/{hashlib.sha256(data).hexdigest()}.safetensors"


def backend_config(request, tmp_path) -> StoreConfig:
    """A store's config on local files, or on the session's SeaweedFS under a prefix of its own
    (request.param: "file" or "s3")."""
    if request.param == "s3":
        s3 = request.getfixturevalue("seaweedfs_s3")
        return StoreConfig(url=f"s3://{s3.bucket}/{uuid.uuid4().hex}", chunk_bytes=16 * 1024,
                           s3_endpoint_url=s3.endpoint_url)
    return file_config(tmp_path)


def pages_for(runner, config_json: str, data: bytes) -> tuple[int, ...]:
    """Blocks for an adapter's weights in `runner`'s KV cache, as a scheduler gives them with a
    LoadAdapter (free ones, as many as its ranks take)."""
    weights = parse_peft_adapter(config_json, data, runner.config, max_rank=runner.pool.max_rank)
    return tuple(runner.free_blocks()[:runner.pool.pages_for(weights).num_pages])


def make_adapter(seed=0, **kwargs) -> tuple[str, bytes]:
    return lora_config(), safetensors.torch.save(lora_tensors(seed=seed, **kwargs))


class Pause:
    """Holds one write or delete of a key: `reached` is set when it gets there, and it goes on
    once released."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self._go = asyncio.Event()

    def release(self) -> None:
        self._go.set()

    async def hold(self) -> None:
        self.reached.set()
        await self._go.wait()


class CountingBlobStore(BlobStore):
    """The real blob store, with every get counted per key and optionally slowed down, and a
    put or delete of a given key held on request (`pause`)."""

    def __init__(self, inner: BlobStore):
        self.inner = inner
        self.description = inner.description
        self.num_gets: collections.Counter[str] = collections.Counter()
        self.get_delay_s = 0.0
        self.gate: asyncio.Event | None = None  # when set, weight reads wait for it
        self._pauses: dict[tuple[str, str], Pause] = {}  # (operation, key) -> its next pause

    def pause(self, operation: str, key: str) -> Pause:
        """Hold the next `operation` ("put" or "delete") of `key` until released."""
        pause = self._pauses[(operation, key)] = Pause()
        return pause

    async def _held(self, operation: str, key: str) -> None:
        pause = self._pauses.pop((operation, key), None)
        if pause is not None:
            await pause.hold()

    async def get_with_etag(self, key):
        self.num_gets[key] += 1
        await asyncio.sleep(self.get_delay_s)
        return await self.inner.get_with_etag(key)

    async def iter_parts(self, key):
        self.num_gets[key] += 1
        await asyncio.sleep(self.get_delay_s)
        if self.gate is not None:
            await self.gate.wait()
        async with contextlib.aclosing(self.inner.iter_parts(key)) as parts:
            async for part in parts:
                yield part

    async def put(self, key, data, **conditions):
        await self._held("put", key)
        await self.inner.put(key, data, **conditions)

    async def delete(self, key):
        await self._held("delete", key)
        await self.inner.delete(key)

    async def list_objects(self, prefix):
        return await self.inner.list_objects(prefix)

    async def read_external(self, uri):
        return await self.inner.read_external(uri)

    async def close(self):
        await self.inner.close()


class Store:
    """A started store with a client stub; `restart()` keeps the same config."""

    def __init__(self, config: StoreConfig):
        self.config = config

    async def start(self) -> "Store":
        self.blobs = CountingBlobStore(await open_blob_store(self.config))
        self.running = await start_store(self.config, blobs=self.blobs)
        self.channel = insecure_channel(self.running.address)
        self.stub = adapter_store_pb2_grpc.AdapterStoreStub(self.channel)
        return self

    async def stop(self) -> None:
        await self.channel.close()
        await self.running.stop(grace=1.0)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def push(self, name, config_json, data, owner="", filename=WEIGHTS, num_bytes=None,
                   chunk=20_000):
        header = pb.PushHeader(name=name, owner_tenant=owner, config_json=config_json,
                               weights_filename=filename,
                               num_bytes=len(data) if num_bytes is None else num_bytes)
        return await client.push(self.stub, header, data, chunk_bytes=chunk)

    async def fetch(self, name, version):
        request = pb.FetchRequest(adapter=common_pb2.AdapterRef(name=name, version=version))
        responses = [r async for r in self.stub.Fetch(request)]
        assert responses[0].WhichOneof("payload") == "info"
        assert all(r.WhichOneof("payload") == "chunk" for r in responses[1:])
        return responses[0].info, b"".join(r.chunk for r in responses[1:])


def file_config(tmp_path) -> StoreConfig:
    return StoreConfig(url=(tmp_path / "store").as_uri(), chunk_bytes=16 * 1024)


async def expect_error(code: grpc.StatusCode, awaitable) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await awaitable
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def call_rpc(stub, method: str, request, **kw):
    """One store RPC, awaitable; the streaming Fetch is read to its end."""
    call = getattr(stub, method)(request, **kw)
    return _read_all(call) if method == "Fetch" else call


async def _read_all(call) -> list:
    return [message async for message in call]

