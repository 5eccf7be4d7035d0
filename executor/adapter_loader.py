"""Brings an adapter version from an adapter store into a slot of the pool.

Bytes stream in chunks from the first store that answers, are checked against the size and sha256
the store announced, parsed and validated against the base model off the event loop, and only
then copied into the slot, so a bad or partial adapter never reaches the pool.
"""

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass

import grpc

from executor.peft_adapter import AdapterError, BaseModelMismatchError, parse_peft_adapter
from executor.runner import ModelRunner
from loraplex.errors import (DataLoss, FailedPrecondition, InvalidArgument, LoraplexError,
                             Unavailable, from_rpc_error)
from loraplex.server import insecure_channel
from protos import adapter_store_pb2, adapter_store_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    num_bytes: int
    load_seconds: float
    was_resident: bool


class AdapterLoader:
    def __init__(self, runner: ModelRunner, stores: tuple[str, ...]):
        self._runner = runner
        self._stubs = [adapter_store_pb2_grpc.AdapterStoreStub(insecure_channel(a)) for a in stores]
        self._stores = stores
        self._locks = [asyncio.Lock() for _ in range(runner.pool.num_slots)]
        self.slot_adapters = [""] * runner.pool.num_slots  # "name@version" per slot

    async def load(self, name: str, version: int, slot: int) -> LoadResult:
        if not 0 <= slot < len(self.slot_adapters):
            raise InvalidArgument(f"slot {slot} does not exist (executor has {len(self.slot_adapters)})")
        key = f"{name}@{version}"
        async with self._locks[slot]:
            if self.slot_adapters[slot] == key:
                return LoadResult(0, 0.0, True)
            start = time.perf_counter()
            config_json, data = await self._fetch(name, version)
            try:
                weights = await asyncio.to_thread(
                    parse_peft_adapter, json.loads(config_json), data, self._runner.config,
                    max_rank=self._runner.pool.max_rank)
            except BaseModelMismatchError as err:
                raise FailedPrecondition(f"adapter {key}: {err}") from None
            except AdapterError as err:
                raise InvalidArgument(f"adapter {key}: {err}") from None
            self.slot_adapters[slot] = ""
            await asyncio.to_thread(self._runner.load_adapter, slot, weights)
            self.slot_adapters[slot] = key
            seconds = time.perf_counter() - start
            log.info("loaded %s into slot %d: %d bytes in %.3fs", key, slot, len(data), seconds)
            return LoadResult(len(data), seconds, False)

    async def unload(self, slot: int) -> None:
        if not 0 <= slot < len(self.slot_adapters):
            raise InvalidArgument(f"slot {slot} does not exist (executor has {len(self.slot_adapters)})")
        async with self._locks[slot]:
            self.slot_adapters[slot] = ""
            await asyncio.to_thread(self._runner.unload_adapter, slot)

    async def _fetch(self, name: str, version: int) -> tuple[str, bytes]:
        """(adapter_config.json, safetensors bytes) from the first store that can serve them."""
        last: LoraplexError = Unavailable("no adapter store configured")
        for address, stub in zip(self._stores, self._stubs):
            try:
                return await self._fetch_from(stub, name, version)
            except grpc.aio.AioRpcError as err:
                last = from_rpc_error(err, f"adapter store {address}")
                if not isinstance(last, Unavailable):
                    raise last from None
            except DataLoss as err:
                last = err
        raise last

    @staticmethod
    async def _fetch_from(stub: adapter_store_pb2_grpc.AdapterStoreStub, name: str,
                          version: int) -> tuple[str, bytes]:
        info, chunks = None, []
        async for msg in stub.Fetch(adapter_store_pb2.FetchRequest(name=name, version=version)):
            if msg.HasField("info"):
                info = msg.info
            else:
                chunks.append(msg.chunk)
        data = b"".join(chunks)
        if info is None:
            raise DataLoss(f"adapter {name}@{version}: the store sent no metadata")
        if len(data) != info.num_bytes or hashlib.sha256(data).hexdigest() != info.sha256:
            raise DataLoss(f"adapter {name}@{version}: received {len(data)} bytes that do not match "
                           f"the store's size {info.num_bytes} and sha256")
        return info.config_json, data
