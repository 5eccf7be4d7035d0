"""The warm host-RAM tier: adapter bytes in an LRU bounded in bytes, in front of the blob store.

Concurrent requests for a cold adapter share one blob read (single-flight), and each of them
streams the read's parts as they arrive from the blob store, in order, instead of waiting for the
whole object. Every blob read is hashed as it arrives and checked against the registry's size and
sha256; a mismatch is read again (a torn or flipped read in transit heals), and after
`read_attempts` mismatching reads raises DataLoss. Nothing that fails the check is cached, and a
follower never receives the last part of a read that failed it: the newest part is held back
until the next one arrives or the check passes, and after a failed read followers get RESTART
and the next read from its first byte. (The executor checks size and sha256 again before a byte
goes to a GPU.)
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import logging
from collections.abc import AsyncIterator

from adapter_store.blobs import BlobStore
from adapter_store.records import AdapterRecord
from loraplex.errors import DataLoss, NotFound

log = logging.getLogger(__name__)

_Key = tuple[str, int]  # (name, version); versions are immutable
_Parts = tuple[bytes, ...]  # an adapter's bytes, in the pieces the blob store returned
_RETRY_DELAY_S = 0.05


class Restart:
    """Marker in a stream: discard the bytes so far, the object follows again from its start."""


RESTART = Restart()


@dataclasses.dataclass
class CacheStats:
    hits: int = 0  # requests served from RAM
    misses: int = 0  # requests that started a blob read
    joined: int = 0  # requests that waited on a read another request started
    blob_reads: int = 0  # whole-object reads from the blob store (retries included)
    bytes_read: int = 0
    checksum_failures: int = 0  # reads whose size or sha256 did not match the registry
    evictions: int = 0


class _Flight:
    """One read of an adapter from the blob store (its attempts included), and the parts that
    arrived so far, for every request that follows it."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []  # of the current attempt; a new attempt gets a new list
        self.is_verified = False
        self.error: BaseException | None = None
        self._changed = asyncio.Event()
        self.task: asyncio.Task[_Parts] | None = None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def new_attempt(self) -> None:
        self.parts = []
        self._notify()

    def add(self, part: bytes) -> None:
        self.parts.append(part)
        self._notify()

    def verified(self) -> None:
        self.is_verified = True
        self._notify()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._notify()

    async def follow(self) -> AsyncIterator[bytes | Restart]:
        """The parts in order: all but the newest as they come, the last once verified."""
        parts: list[bytes] | None = None
        num_sent = 0
        while True:
            changed = self._changed
            if self.error is not None:
                raise self.error
            if self.parts is not parts:  # (a failed check started) a new attempt
                if num_sent:
                    yield RESTART
                parts, num_sent = self.parts, 0
            num_ready = len(parts) if self.is_verified else len(parts) - 1
            if num_sent < num_ready:
                yield parts[num_sent]
                num_sent += 1
            elif self.is_verified:
                return
            else:
                await changed.wait()


class HostCache:
    """Whole adapters in host RAM, at most `capacity_bytes` in all (an adapter larger than that is
    served but not kept)."""

    def __init__(self, blobs: BlobStore, capacity_bytes: int, read_attempts: int = 3):
        self._blobs = blobs
        self.capacity_bytes = capacity_bytes
        self.read_attempts = read_attempts
        self.num_bytes = 0
        self.stats = CacheStats()
        self._entries: collections.OrderedDict[_Key, _Parts] = collections.OrderedDict()  # LRU 1st
        self._in_flight: dict[_Key, _Flight] = {}
        # Hashes each read's parts in order while the next ones arrive (hashlib drops the GIL).
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sha256")

    def __contains__(self, record: AdapterRecord) -> bool:
        return (record.name, record.version) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    async def stream(self, record: AdapterRecord) -> AsyncIterator[bytes | Restart]:
        """The adapter's weights in pieces, from RAM or (one read for all concurrent callers)
        from the blob store as they arrive; RESTART means: drop what came before, start over."""
        parts = self._hit(record)
        if parts is not None:
            for part in parts:
                yield part
            return
        async for piece in self._flight(record).follow():
            yield piece

    async def warm(self, record: AdapterRecord) -> None:
        """Bring the adapter into RAM (when it fits), reading it once for all concurrent callers."""
        if self._hit(record) is None:
            # A cancelled caller must not cancel the read the others wait on.
            await asyncio.shield(self._flight(record).task)

    def evict(self, name: str, version: int) -> None:
        parts = self._entries.pop((name, version), None)
        if parts is not None:
            self.num_bytes -= sum(map(len, parts))

    def _hit(self, record: AdapterRecord) -> _Parts | None:
        key = (record.name, record.version)
        parts = self._entries.get(key)
        if parts is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
        return parts

    def _flight(self, record: AdapterRecord) -> _Flight:
        """The read of `record` in progress, started if there is none."""
        key = (record.name, record.version)
        flight = self._in_flight.get(key)
        if flight is not None:
            self.stats.joined += 1
            return flight
        self.stats.misses += 1
        flight = self._in_flight[key] = _Flight()
        flight.task = asyncio.create_task(self._load(record, flight),
                                          name=f"load {record.weights_key}")
        flight.task.add_done_callback(lambda done: self._finish(key, flight, done))
        return flight

    def _finish(self, key: _Key, flight: _Flight, task: asyncio.Task[_Parts]) -> None:
        self._in_flight.pop(key, None)
        if task.cancelled():
            flight.fail(DataLoss(f"the read of {key[0]}@{key[1]} was cancelled; fetch again"))
        elif task.exception() is not None:  # retrieved here, so an unwatched read logs nothing
            flight.fail(task.exception())

    async def _load(self, record: AdapterRecord, flight: _Flight) -> _Parts:
        for attempt in range(1, self.read_attempts + 1):
            self.stats.blob_reads += 1
            if attempt > 1:
                flight.new_attempt()
            num_bytes, digest = await self._read(record, flight)
            self.stats.bytes_read += num_bytes
            if num_bytes == record.num_bytes and digest == record.sha256:
                parts = tuple(flight.parts)
                flight.verified()
                self._insert((record.name, record.version), parts, num_bytes)
                return parts
            self.stats.checksum_failures += 1
            log.error("%s (read %d/%d): %d bytes with sha256 %s, registry says %d bytes with %s",
                      record.weights_key, attempt, self.read_attempts, num_bytes, digest,
                      record.num_bytes, record.sha256)
            if attempt < self.read_attempts:
                await asyncio.sleep(_RETRY_DELAY_S * attempt)
        raise DataLoss(f"adapter {record.ref} is corrupted in the blob store (sha256 mismatch "
                       f"on {self.read_attempts} reads); push it again")

    async def _read(self, record: AdapterRecord, flight: _Flight) -> tuple[int, str]:
        """One read into `flight`, hashed as it arrives: (bytes read, hex sha256). Stops early
        once the object is longer than the registry says (the check fails anyway)."""
        loop = asyncio.get_running_loop()
        digest, hashed, num_bytes = hashlib.sha256(), [], 0
        try:
            parts = self._blobs.iter_parts(record.weights_key)
            try:
                async for part in parts:
                    hashed.append(loop.run_in_executor(self._hasher, digest.update, part))
                    flight.add(part)
                    num_bytes += len(part)
                    if num_bytes > record.num_bytes:
                        break
            finally:
                await parts.aclose()
        except NotFound:
            raise DataLoss(f"adapter {record.ref} is registered but its weights are missing "
                           "from the blob store; push it again") from None
        finally:
            await asyncio.gather(*hashed, return_exceptions=True)
        return num_bytes, digest.hexdigest()

    def _insert(self, key: _Key, parts: _Parts, num_bytes: int) -> None:
        if num_bytes > self.capacity_bytes:
            return
        while self.num_bytes + num_bytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= sum(map(len, evicted))
            self.stats.evictions += 1
        self._entries[key] = parts
        self.num_bytes += num_bytes
