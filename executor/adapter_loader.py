"""Brings an adapter version from an adapter store into a slot of the pool.

The path, and why each step sits where it does:
1. Fetch (store_fetch.py): chunks stream from the first store that answers into a reused host
   staging buffer (pinned on CUDA), written as they come; one worker thread checksums them in order
   while the next chunks are on the wire, so the check costs little after the last byte. Size and
   checksum must match what the store announced, else DATA_LOSS (and the next store is tried): a
   bad or partial adapter never reaches the pool. The checksum is the version's CRC-32: the store
   checked the bytes it read against sha256, and here the check is against errors between store and
   executor, which CRC-32 catches as well at a quarter of sha256's CPU (64 MiB: ~10 ms instead of
   ~33; sha256 would add nothing, its expected value comes from the same store). Versions
   registered before CRC-32s were recorded are checked against sha256. A `restart` message (the
   store's own read failed its check and was read again) discards what came before it. A live store
   answers a Fetch's first message (the version's metadata) from memory: one that sends nothing
   within `first_answer_s` is frozen or swamped, and the next store is tried. Stores are tried in
   their configured order, those that failed last tried last.
2. Parse: PEFT config + safetensors, validated against the base model, in a worker thread; the
   tensors are views into the staging buffer, not copies. It starts once the last chunk is
   written, beside the checksum of the last chunks; its result is used only once the checksum
   matched (a mismatch is DATA_LOSS, whatever the parse made of the bytes).
3. Copy: on CUDA, from the pinned staging buffer into the slot on a side CUDA stream, in a worker
   thread; the step loop (its own thread, default stream) never waits on a load. On CPU it is a
   plain copy. The slot reads as empty until the copy is complete.
On rank 0 of a tensor-parallel executor, once its own copy (or clear) is done, the other ranks are
told (`followers`, executor/tp/followers.py: each gets its part of the adapter) before the slot
counts as loaded.
What each slot holds is the pool's record (executor/lora/slot_pool.py): the loader marks a slot
unloaded before its copy and loaded, as the AdapterRef, once the copy completed; `slot_adapters`
reads it back.
The measured seconds from request to slot ready go back in LoadAdapterResponse.load_seconds.

Residency: after every load or unload, and every `report_interval_s`, the loader reports the
adapters it holds to a store (ReportResidency), which pins them against deletion for one lease TTL.
"""

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass

import grpc
import torch

from common.adapter_ref import AdapterRef
from common.base_fingerprint import is_same_base
from common.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    LoraplexError,
)
from common.server import insecure_channel
from executor.config import FETCH_CHUNK_TIMEOUT_S
from executor.lora.peft_adapter import parse_peft_adapter
from executor.lora.slot_copy import SlotCopier, StagingBuffers
from executor.lora.slot_pool import LoraWeights
from executor.lora.staged import Staged, StagedAdapters
from executor.runner import ModelRunner
from executor.store_fetch import FIRST_ANSWER_S, StoreFetcher
from executor.tp.followers import Followers
from protos import adapter_store_pb2, adapter_store_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 10.0
FETCH_TIMEOUT_S = 120.0  # a fetch from the stores, when the caller's RPC gives no deadline
STAGED_TTL_S = 180.0  # staged bytes no load took are dropped after this long
LEASE_TTL_S = 30.0


@dataclass(frozen=True)
class LoadResult:
    num_bytes: int
    load_seconds: float
    was_resident: bool


class AdapterLoader:
    def __init__(self, runner: ModelRunner, stores: tuple[str, ...], holder: str = "",
                 service_key: str = "", max_staged_bytes: int = 1 << 30,
                 report_interval_s: float = REPORT_INTERVAL_S,
                 first_answer_s: float = FIRST_ANSWER_S,
                 chunk_timeout_s: float = FETCH_CHUNK_TIMEOUT_S,
                 followers: Followers | None = None):
        self._runner = runner
        self._followers = followers
        self._pool = runner.pool
        self._stubs = [adapter_store_pb2_grpc.AdapterStoreStub(insecure_channel(a, service_key))
                       for a in stores]
        self._stores = stores
        self._locks = [asyncio.Lock() for _ in range(self._pool.num_slots)]
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}"
        self._report_interval_s = report_interval_s
        self._report_wanted = asyncio.Event()
        self._reporter: asyncio.Task | None = None
        self._copier = SlotCopier(self._pool)
        self._staging = StagingBuffers(pin_memory=runner.device.type == "cuda")
        self._staged = StagedAdapters(self._staging.release, max_staged_bytes, STAGED_TTL_S)
        self._stagings: dict[AdapterRef, asyncio.Future[Staged]] = {}  # fetches under way
        self._fetcher = StoreFetcher(list(zip(stores, self._stubs)), self._staging, self._parse,
                                     first_answer_s, chunk_timeout_s)
        # The id of the Step stream that drives the executor now (None between streams): loads
        # and unloads bound to another stream are refused where they write (see _write).
        self.stream_id: str | None = None

    @property
    def slot_adapters(self) -> list[AdapterRef | None]:
        """The adapter loaded in each slot (None: empty, or a copy under way), from the pool."""
        return self._pool.adapters()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._pool.num_slots:
            raise InvalidArgument(f"slot {slot} does not exist (executor has "
                                  f"{self._pool.num_slots})")

    async def stage(self, adapter: AdapterRef, timeout_s: float = FETCH_TIMEOUT_S) -> LoadResult:
        """Fetch, check and parse `adapter` onto the host, touching no slot (see
        executor/lora/staged.py); concurrent calls for one adapter share one fetch. was_resident:
        it was staged already."""
        if adapter in self._staged:
            return LoadResult(0, 0.0, True)
        flight = self._stagings.get(adapter)
        if flight is None:
            flight = self._stagings[adapter] = asyncio.ensure_future(
                self._stage_now(adapter, timeout_s))
            flight.add_done_callback(lambda _: self._stagings.pop(adapter, None))
        staged = await asyncio.shield(flight)  # a cancelled caller leaves it to finish
        return LoadResult(staged.num_bytes, staged.seconds, False)

    async def _stage_now(self, adapter: AdapterRef, timeout_s: float) -> Staged:
        start = time.perf_counter()
        buffer, num_bytes, weights = await self._fetcher.fetch(adapter, timeout_s)
        staged = Staged(buffer, num_bytes, weights, time.perf_counter() - start, time.monotonic())
        self._staged.put(adapter, staged)
        log.info("staged %s: %d bytes in %.4fs", adapter, num_bytes, staged.seconds)
        return staged

    async def _take_staged(self, adapter: AdapterRef) -> Staged | None:
        """Its staged bytes (waiting for a staging of it under way), no longer kept staged."""
        flight = self._stagings.get(adapter)
        if flight is not None:
            await asyncio.gather(asyncio.shield(flight), return_exceptions=True)
        return self._staged.take(adapter)

    async def load(self, adapter: AdapterRef, slot: int, pages: tuple[int, ...],
                   timeout_s: float = FETCH_TIMEOUT_S, only_staged: bool = False,
                   stream_id: str = "") -> LoadResult:
        """Place `adapter` in `slot`, its weights in `pages` (KV blocks the scheduler gave it):
        from its staged bytes, else fetched now (with `only_staged`: else ABORTED, the slot
        untouched). FAILED_PRECONDITION when the slot is merged into the weights, when the
        pages do not fit the adapter, or when `stream_id` (if given) is no longer the driving
        step stream (each checked where the copy starts, under the lock merges take)."""
        self._check_slot(slot)
        async with self._locks[slot]:
            self._check_stream(slot, stream_id)  # (again where it writes: it may end meanwhile)
            if self._pool.holds(slot, adapter) and self._pool.contents(slot).pages == tuple(pages):
                return LoadResult(0, 0.0, True)  # (in other pages: copied there again)
            start = time.perf_counter()
            staged = await self._take_staged(adapter)
            if staged is None and only_staged:
                raise Aborted(f"adapter {adapter} is not staged here (dropped for its age or the "
                              f"staging budget); slot {slot} is unchanged: stage it again")
            if staged is None:
                staging, num_bytes, weights = await self._fetcher.fetch(adapter, timeout_s)
            else:
                staging, num_bytes, weights = staged.buffer, staged.num_bytes, staged.weights
            try:
                fetched = time.perf_counter()
                # Empty while the copy runs (marked so by _write, once it is sure the slot is
                # not merged). Reported once the load ends (below, or on failure): a report now
                # would put its RPC and lease write beside the copy, for nothing.
                try:
                    await _thread_to_its_end(self._write, slot, stream_id, self._copier.copy,
                                             self._runner.shard.lora(weights), tuple(pages))
                    if self._followers is not None:  # (outside slot_writes: see tp/followers.py)
                        await _thread_to_its_end(self._followers.load, slot, weights,
                                                 tuple(pages))
                except BaseException:
                    self._residency_changed()
                    raise
                del weights  # views into the staging buffer
            finally:
                self._staging.release(staging)
            self._pool.mark_loaded(slot, adapter)  # (a failed or cancelled copy never gets here)
            self._residency_changed()
            seconds = time.perf_counter() - start
            log.info("loaded %s into slot %d: %d bytes in %.4fs (fetch + check + parse %.4f, "
                     "copy %.4f)", adapter, slot, num_bytes, seconds, fetched - start,
                     seconds - (fetched - start))
            return LoadResult(num_bytes, seconds, False)

    async def unload(self, slot: int, adapter: AdapterRef | None = None,
                     stream_id: str = "") -> None:
        """Empty `slot`; with `adapter`, only while the slot still holds that adapter; with
        `stream_id`, only while that step stream drives the executor (as `load`)."""
        self._check_slot(slot)
        async with self._locks[slot]:
            if adapter is not None and not self._pool.holds(slot, adapter):
                return
            await _thread_to_its_end(self._write, slot, stream_id, self._copier.clear)
            if self._followers is not None:
                await _thread_to_its_end(self._followers.clear, slot)
        self._residency_changed()

    def _check_stream(self, slot: int, stream_id: str) -> None:
        if stream_id and stream_id != self.stream_id:
            raise FailedPrecondition(f"adapter slot {slot}: the step stream this call belongs "
                                     "to has ended (its blocks are given out anew)")

    async def unload_all(self) -> None:
        """Empty every slot: the scheduler whose blocks their pages were has gone (its step
        stream ended); the next one gives out every block afresh."""
        for slot in range(self._pool.num_slots):
            await self.unload(slot)

    def _parse(self, key: str, info: common_pb2.AdapterInfo, data: torch.Tensor) -> LoraWeights:
        """Runs in a worker thread: the PEFT adapter in `data`, validated; views into it. Its
        base is the one the store matched it to (info.base_model, by id or fingerprint), not
        the text of its config (a path on the machine it was trained on)."""
        model_id = self._runner.config.model_id
        try:
            if not is_same_base(info, model_id, self._runner.base_fingerprint):
                raise FailedPrecondition(f"adapter was trained on base model "
                                         f"{info.base_model!r}, this pool serves {model_id!r}")
            return parse_peft_adapter(info.config_json, data, self._runner.config,
                                      max_rank=self._pool.max_rank, check_base_model=False,
                                      dtype=None)
        except LoraplexError as err:
            raise type(err)(f"adapter {key}: {err}") from None

    def _write(self, slot: int, stream_id: str, write, *args) -> None:
        """On a worker thread: mark `slot` unloaded and `write(slot, *args)`, unless it is merged
        into the weights or `stream_id` (if given) has ended: the checks and the write under the
        lock a merge takes (a merge that began during the fetch is seen here; none can start
        between them) and the slot's (a stream's end empties every slot, each under its lock)."""
        with self._runner.slot_writes:
            self._check_stream(slot, stream_id)
            if slot == self._runner.merged_slot:
                raise FailedPrecondition(f"adapter slot {slot} is merged into the weights: "
                                         "unmerge it (a Step with unmerge) before replacing it")
            self._pool.mark_unloaded(slot)
            try:
                write(slot, *args)
            except ValueError as err:  # (the pages do not fit the adapter)
                raise FailedPrecondition(f"slot {slot}: {err}") from None

    async def close(self) -> None:
        """Stop the background residency reports."""
        if self._reporter is not None:
            self._reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reporter
            self._reporter = None

    # ----- residency reports -----

    def _residency_changed(self) -> None:
        self._report_wanted.set()
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.create_task(self._report_loop(), name="residency reports")

    async def _report_loop(self) -> None:
        while True:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that arrives as the event
            # fires, and close() then waited forever (a hang seen about 1 test run in 7).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._report_interval_s):
                    await self._report_wanted.wait()
            self._report_wanted.clear()
            await self.report_residency()

    async def report_residency(self) -> bool:
        """Tell one store what this executor holds; False (logged) when no store answered."""
        report = adapter_store_pb2.ResidencyReport(
            holder=self.holder, adapters=[a.to_pb() for a in self.slot_adapters if a],
            ttl_seconds=max(LEASE_TTL_S, 3 * self._report_interval_s))
        for address, stub in zip(self._stores, self._stubs):
            try:
                await stub.ReportResidency(report, timeout=5)
                return True
            except grpc.aio.AioRpcError as err:
                log.warning("residency report to %s failed: %s", address, err.details())
        return False


async def _thread_to_its_end(fn, *args) -> None:
    """fn(*args) on a worker thread. Cancelled or failed, it still waits for the thread: the slot
    lock and the staging buffer are released only once the thread no longer touches them (a
    cancelled clear running on beside the next load zeroed the slot it had just filled)."""
    running = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await asyncio.shield(running)
    except BaseException:
        await asyncio.wait([running])
        raise
