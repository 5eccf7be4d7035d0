"""Brings an adapter version from an adapter store into a slot of the pool.

The path, and why each step sits where it does:
1. Fetch: chunks stream from the first store that answers; each chunk is hashed as it arrives, so
   the sha256 check costs nothing after the last byte. Size and sha256 must match what the store
   announced, else DATA_LOSS (and the next store is tried): a bad or partial adapter never
   reaches the pool.
2. Parse: PEFT config + safetensors, validated against the base model, in a worker thread.
3. Copy: on CUDA, tensors go through pinned host staging and are copied into the slot on a side
   CUDA stream, in a worker thread; the step loop (its own thread, default stream) never waits on
   a load. On CPU it is a plain copy. The slot reads as empty until the copy is complete.
The measured seconds from request to slot ready go back in LoadAdapterResponse.load_seconds.

Residency: after every load or unload, and every `report_interval_s`, the loader reports the
adapters it holds to a store (ReportResidency), which pins them against deletion for one lease TTL.
"""

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass

import grpc
import torch

from executor.lora import LoraModuleWeights, LoraWeights
from executor.peft_adapter import AdapterError, BaseModelMismatchError, parse_peft_adapter
from executor.runner import ModelRunner
from loraplex.errors import (DataLoss, FailedPrecondition, InvalidArgument, LoraplexError,
                             Unavailable, from_rpc_error)
from loraplex.server import insecure_channel
from protos import adapter_store_pb2, adapter_store_pb2_grpc

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 10.0
LEASE_TTL_S = 30.0


@dataclass(frozen=True)
class LoadResult:
    num_bytes: int
    load_seconds: float
    was_resident: bool


class AdapterLoader:
    def __init__(self, runner: ModelRunner, stores: tuple[str, ...], holder: str = "",
                 report_interval_s: float = REPORT_INTERVAL_S):
        self._runner = runner
        self._stubs = [adapter_store_pb2_grpc.AdapterStoreStub(insecure_channel(a)) for a in stores]
        self._stores = stores
        self._locks = [asyncio.Lock() for _ in range(runner.pool.num_slots)]
        self.slot_adapters = [""] * runner.pool.num_slots  # "name@version" per slot
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}"
        self._report_interval_s = report_interval_s
        self._report_wanted = asyncio.Event()
        self._reporter: asyncio.Task | None = None
        is_cuda = runner.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(runner.device) if is_cuda else None

    async def load(self, name: str, version: int, slot: int) -> LoadResult:
        if not 0 <= slot < len(self.slot_adapters):
            raise InvalidArgument(f"slot {slot} does not exist (executor has {len(self.slot_adapters)})")
        key = f"{name}@{version}"
        async with self._locks[slot]:
            if self.slot_adapters[slot] == key:
                return LoadResult(0, 0.0, True)
            start = time.perf_counter()
            config_json, data = await self._fetch(name, version)
            fetched = time.perf_counter()
            try:
                weights = await asyncio.to_thread(
                    parse_peft_adapter, json.loads(config_json), data, self._runner.config,
                    max_rank=self._runner.pool.max_rank)
            except BaseModelMismatchError as err:
                raise FailedPrecondition(f"adapter {key}: {err}") from None
            except AdapterError as err:
                raise InvalidArgument(f"adapter {key}: {err}") from None
            parsed = time.perf_counter()
            self.slot_adapters[slot] = ""
            self._residency_changed()
            await asyncio.to_thread(self._copy_into_slot, slot, weights)
            self.slot_adapters[slot] = key
            self._residency_changed()
            seconds = time.perf_counter() - start
            log.info("loaded %s into slot %d: %d bytes in %.3fs (fetch %.3f, parse %.3f, copy "
                     "%.3f)", key, slot, len(data), seconds, fetched - start, parsed - fetched,
                     seconds - (parsed - start))
            return LoadResult(len(data), seconds, False)

    async def unload(self, slot: int, adapter: str = "") -> None:
        """Empty `slot`; with `adapter`, only while the slot still holds that adapter."""
        if not 0 <= slot < len(self.slot_adapters):
            raise InvalidArgument(f"slot {slot} does not exist (executor has {len(self.slot_adapters)})")
        async with self._locks[slot]:
            if adapter and self.slot_adapters[slot] != adapter:
                return
            self.slot_adapters[slot] = ""
            await asyncio.to_thread(self._runner.unload_adapter, slot)
        self._residency_changed()

    def _copy_into_slot(self, slot: int, weights: LoraWeights) -> None:
        """Runs in a worker thread. CUDA: pinned staging, then copies on the side stream."""
        if self._copy_stream is None:
            self._runner.load_adapter(slot, weights)
            return
        staged = LoraWeights(modules={
            key: LoraModuleWeights(a=w.a.pin_memory(), b=w.b.pin_memory(), scale=w.scale)
            for key, w in weights.modules.items()})
        with torch.cuda.stream(self._copy_stream):
            self._runner.load_adapter(slot, staged)
        self._copy_stream.synchronize()  # this thread waits; the step loop's stream does not

    async def _fetch(self, name: str, version: int) -> tuple[str, bytes]:
        """(adapter_config.json, safetensors bytes) from the first store that can serve them."""
        last: LoraplexError = Unavailable("no adapter store configured")
        for address, stub in zip(self._stores, self._stubs):
            try:
                return await self._fetch_from(stub, name, version)
            except grpc.aio.AioRpcError as err:
                last = from_rpc_error(err, f"adapter store {address}")
                if not isinstance(last, (Unavailable, DataLoss)):
                    raise last from None
            except DataLoss as err:
                last = err
        raise last

    @staticmethod
    async def _fetch_from(stub: adapter_store_pb2_grpc.AdapterStoreStub, name: str,
                          version: int) -> tuple[str, bytes]:
        info, chunks, num_bytes, digest = None, [], 0, hashlib.sha256()
        async for msg in stub.Fetch(adapter_store_pb2.FetchRequest(name=name, version=version)):
            if msg.HasField("info"):
                info = msg.info
                continue
            num_bytes += len(msg.chunk)
            if info is None or num_bytes > info.num_bytes:
                raise DataLoss(f"adapter {name}@{version}: the store sent bytes beyond the "
                               "announced size, or no metadata first")
            digest.update(msg.chunk)  # hashed while the next chunk is on the wire
            chunks.append(msg.chunk)
        if info is None:
            raise DataLoss(f"adapter {name}@{version}: the store sent no metadata")
        if num_bytes != info.num_bytes or digest.hexdigest() != info.sha256:
            raise DataLoss(f"adapter {name}@{version}: received {num_bytes} bytes that do not "
                           f"match the store's size {info.num_bytes} and sha256")
        return info.config_json, b"".join(chunks)

    # ----- residency reports -----

    def _residency_changed(self) -> None:
        self._report_wanted.set()
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.create_task(self._report_loop(), name="residency reports")

    async def _report_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._report_wanted.wait(), self._report_interval_s)
            self._report_wanted.clear()
            await self.report_residency()

    async def report_residency(self) -> bool:
        """Tell one store what this executor holds; False (logged) when no store answered."""
        report = adapter_store_pb2.ResidencyReport(
            holder=self.holder, adapters=[a for a in self.slot_adapters if a],
            ttl_seconds=max(LEASE_TTL_S, 3 * self._report_interval_s))
        for address, stub in zip(self._stores, self._stubs):
            try:
                await stub.ReportResidency(report, timeout=5)
                return True
            except grpc.aio.AioRpcError as err:
                log.warning("residency report to %s failed: %s", address, err.details())
        return False
