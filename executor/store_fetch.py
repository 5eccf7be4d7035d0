"""Fetching an adapter's bytes from the adapter stores into a host staging buffer, checked (step 1
of adapter_loader.py): stores tried in order, those that failed last tried last; a store that
sends nothing first within `first_answer_s`, or stalls mid-stream (no next message within
`chunk_timeout_s`, the executor's --fetch-chunk-timeout-s), is passed over, so a frozen store
costs a fetch one such wait, not its deadline. The next store sends the adapter again from byte 0:
Fetch takes no offset to resume at (FetchRequest). Size and checksum must match what the store
announced, else DATA_LOSS and the next store."""

import asyncio
import concurrent.futures
import hashlib
import logging
import math
import time
import zlib
from collections.abc import AsyncIterator, Callable

import grpc
import torch

from common.adapter_ref import AdapterRef
from common.errors import DataLoss, LoraplexError, Unavailable, from_rpc_error
from executor.config import FETCH_CHUNK_TIMEOUT_S
from executor.lora.slot_copy import StagingBuffers
from executor.lora.slot_pool import LoraWeights
from protos import adapter_store_pb2, adapter_store_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

FIRST_ANSWER_S = 5.0  # a store that sends no first Fetch message within this is passed over


class _Crc32:
    """A running zlib.crc32 with hashlib's update()."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes) -> None:
        self.value = zlib.crc32(data, self.value)


class _ChunkWriter:
    """Writes a Fetch's chunks in order into a staging buffer as they come (a memcpy, in the
    event loop) and checksums them in one worker thread (zlib and hashlib drop the GIL) while the
    next ones are on the wire: when the stream ends the bytes are in place, and only the checksum
    of the last chunks remains. CRC-32 when `info` has one, else sha256."""

    def __init__(self, buffer: torch.Tensor, worker: concurrent.futures.ThreadPoolExecutor,
                 info: common_pb2.AdapterInfo):
        self._view = memoryview(buffer.numpy())
        self._worker = worker
        self._info = info
        self._digest = self._new_digest()
        self._pending: list[asyncio.Future] = []
        self.num_bytes = 0

    def _new_digest(self) -> "_Crc32 | hashlib._Hash":
        return _Crc32() if self._info.HasField("crc32") else hashlib.sha256()

    def add(self, chunk: bytes) -> bool:
        """Write `chunk` after the previous ones; False when it would overflow the buffer."""
        end = self.num_bytes + len(chunk)
        if end > len(self._view):
            return False
        self._view[self.num_bytes:end] = chunk
        self._pending.append(asyncio.get_running_loop().run_in_executor(
            self._worker, self._digest.update, chunk))
        self.num_bytes = end
        return True

    def restart(self) -> None:
        """Discard everything so far: the object follows again from its first byte."""
        self._digest = self._new_digest()  # updates still queued go to the old one
        self.num_bytes = 0

    async def matches(self) -> bool:
        """Whether the bytes written are all the version's bytes: its size and checksum."""
        await self.wait()
        if self.num_bytes != self._info.num_bytes:
            return False
        if isinstance(self._digest, _Crc32):
            return self._digest.value == self._info.crc32
        return self._digest.hexdigest() == self._info.sha256

    async def wait(self) -> None:
        """Until the worker has hashed everything queued."""
        await asyncio.gather(*self._pending, return_exceptions=True)


async def _bounded(call, first_s: float, next_s: float) -> AsyncIterator:
    """The messages of a server-streaming `call`: the first within `first_s`, each next one within
    `next_s` of the one before (else the call is cancelled: UNAVAILABLE)."""
    messages = aiter(call)
    num_messages = 0
    while True:
        try:
            async with asyncio.timeout(next_s if num_messages else first_s):
                msg = await anext(messages)
        except StopAsyncIteration:
            return
        except TimeoutError:
            call.cancel()
            if not num_messages:
                raise Unavailable(f"sent nothing within {first_s:.1f}s") from None
            raise Unavailable(f"stalled mid-stream: no message for {next_s:.1f}s after "
                              f"{num_messages} messages") from None
        num_messages += 1
        yield msg


class StoreFetcher:
    """Fetches from the stores (address, stub), parsing with `parse(key, info, bytes)` in a
    worker thread."""

    def __init__(self, stores: list[tuple[str, adapter_store_pb2_grpc.AdapterStoreStub]],
                 staging: StagingBuffers,
                 parse: Callable[[str, common_pb2.AdapterInfo, torch.Tensor], LoraWeights],
                 first_answer_s: float = FIRST_ANSWER_S,
                 chunk_timeout_s: float = FETCH_CHUNK_TIMEOUT_S):
        self._stores, self._staging, self._parse = stores, staging, parse
        self._first_answer_s, self._chunk_timeout_s = first_answer_s, chunk_timeout_s
        self._failed_at = [-math.inf] * len(stores)  # when each store last failed a fetch
        self._chunk_worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="adapter-chunks")

    async def fetch(self, adapter: AdapterRef,
                     timeout_s: float) -> tuple[torch.Tensor, int, LoraWeights]:
        """(staging buffer holding the safetensors bytes, their size, the adapter parsed from
        them) from the first store that can serve them, all within `timeout_s`. The caller
        releases the buffer."""
        last: LoraplexError = Unavailable("no adapter store configured")
        deadline = time.monotonic() + timeout_s
        for i in sorted(range(len(self._stores)), key=self._failed_at.__getitem__):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                last = Unavailable(f"adapter {adapter}: no store answered within {timeout_s:.0f}s")
                break
            try:
                return await self._fetch_from(self._stores[i][1], adapter, remaining)
            except grpc.aio.AioRpcError as err:
                last = from_rpc_error(err, f"adapter store {self._stores[i][0]}")
                if not isinstance(last, (Unavailable, DataLoss)):
                    raise last from None
            except (Unavailable, DataLoss) as err:
                last = type(err)(f"adapter store {self._stores[i][0]}: {err}")
            self._failed_at[i] = time.monotonic()
            log.warning("fetch of %s: %s", adapter, last)
        raise last

    async def _fetch_from(self, stub: adapter_store_pb2_grpc.AdapterStoreStub,
                          adapter: AdapterRef,
                          timeout_s: float) -> tuple[torch.Tensor, int, LoraWeights]:
        """Receive, then parse while the hashing of the last chunks finishes; the parse counts
        only once size and checksum matched the store's (else DATA_LOSS, whatever it found)."""
        info, staging, writer, parsing = None, None, None, None
        key = str(adapter)
        call = stub.Fetch(adapter_store_pb2.FetchRequest(adapter=adapter.to_pb()),
                          timeout=timeout_s)
        try:
            async for msg in _bounded(call, min(self._first_answer_s, timeout_s),
                                      self._chunk_timeout_s):
                kind = msg.WhichOneof("payload")
                if kind == "info" and info is None:
                    info = msg.info
                    staging = self._staging.take(info.num_bytes)
                    writer = _ChunkWriter(staging[:info.num_bytes], self._chunk_worker, info)
                elif kind == "restart" and writer is not None:
                    writer.restart()
                elif kind != "chunk" or writer is None or not writer.add(msg.chunk):
                    raise DataLoss(f"adapter {key}: the store sent bytes beyond the announced "
                                   "size, or no metadata first")
            if info is None:
                raise DataLoss(f"adapter {key}: the store sent no metadata")
            if writer.num_bytes == info.num_bytes:
                parsing = asyncio.ensure_future(asyncio.to_thread(
                    self._parse, key, info, staging[:info.num_bytes]))
            if not await writer.matches():
                raise DataLoss(f"adapter {key}: received {writer.num_bytes} bytes that do not "
                               f"match the store's size {info.num_bytes} and checksum")
            return staging, info.num_bytes, await parsing
        except BaseException:
            call.cancel()  # (no-op once the stream ended)
            if parsing is not None:  # (a thread: it runs to its end, cancelled or not)
                await asyncio.gather(parsing, return_exceptions=True)
            if staging is not None:
                await writer.wait()
                self._staging.release(staging)
            raise

