"""The warm host-RAM tier: adapter bytes in an LRU bounded in bytes, in front of the blob store.

Concurrent requests for a cold adapter share one blob read (single-flight). Every blob read is
checked against the registry's size and sha256; a mismatch is read again (a torn or flipped read
in transit heals), and after `read_attempts` mismatching reads raises DataLoss. Nothing that fails
the check is cached or served, so a corrupted object never reaches an executor.
"""

import asyncio
import collections
import dataclasses
import hashlib
import logging

from adapter_store.blobs import BlobStore
from adapter_store.records import AdapterRecord
from loraplex.errors import DataLoss, NotFound

log = logging.getLogger(__name__)

_Key = tuple[str, int]  # (name, version); versions are immutable
_RETRY_DELAY_S = 0.05


@dataclasses.dataclass
class CacheStats:
    hits: int = 0  # requests served from RAM
    misses: int = 0  # requests that started a blob read
    joined: int = 0  # requests that waited on a read another request started
    blob_reads: int = 0  # whole-object reads from the blob store (retries included)
    bytes_read: int = 0
    checksum_failures: int = 0  # reads whose size or sha256 did not match the registry
    evictions: int = 0


class HostCache:
    """Whole adapters in host RAM, at most `capacity_bytes` in all (an adapter larger than that is
    served but not kept)."""

    def __init__(self, blobs: BlobStore, capacity_bytes: int, read_attempts: int = 3):
        self._blobs = blobs
        self.capacity_bytes = capacity_bytes
        self.read_attempts = read_attempts
        self.num_bytes = 0
        self.stats = CacheStats()
        self._entries: collections.OrderedDict[_Key, bytes] = collections.OrderedDict()  # LRU first
        self._in_flight: dict[_Key, asyncio.Task[bytes]] = {}

    def __contains__(self, record: AdapterRecord) -> bool:
        return (record.name, record.version) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, record: AdapterRecord) -> bytes:
        """The adapter's weights, from RAM or (once for all concurrent callers) the blob store."""
        key = (record.name, record.version)
        data = self._entries.get(key)
        if data is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return data
        task = self._in_flight.get(key)
        if task is None:
            self.stats.misses += 1
            task = asyncio.create_task(self._load(record), name=f"load {record.weights_key}")
            self._in_flight[key] = task
            task.add_done_callback(lambda done: self._finish(key, done))
        else:
            self.stats.joined += 1
        # A cancelled caller must not cancel the read the others wait on.
        return await asyncio.shield(task)

    def evict(self, name: str, version: int) -> None:
        data = self._entries.pop((name, version), None)
        if data is not None:
            self.num_bytes -= len(data)

    def _finish(self, key: _Key, task: asyncio.Task[bytes]) -> None:
        self._in_flight.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here too, so a read no caller waited for logs no warning

    async def _load(self, record: AdapterRecord) -> bytes:
        for attempt in range(1, self.read_attempts + 1):
            self.stats.blob_reads += 1
            try:
                data = await self._blobs.get(record.weights_key)
            except NotFound:
                raise DataLoss(f"adapter {record.ref} is registered but its weights are missing "
                               "from the blob store; push it again") from None
            self.stats.bytes_read += len(data)
            digest = await asyncio.to_thread(_sha256, data)
            if len(data) == record.num_bytes and digest == record.sha256:
                self._insert((record.name, record.version), data)
                return data
            self.stats.checksum_failures += 1
            log.error("%s (read %d/%d): %d bytes with sha256 %s, registry says %d bytes with %s",
                      record.weights_key, attempt, self.read_attempts, len(data), digest,
                      record.num_bytes, record.sha256)
            if attempt < self.read_attempts:
                await asyncio.sleep(_RETRY_DELAY_S * attempt)
        raise DataLoss(f"adapter {record.ref} is corrupted in the blob store (sha256 mismatch "
                       f"on {self.read_attempts} reads); push it again")

    def _insert(self, key: _Key, data: bytes) -> None:
        if len(data) > self.capacity_bytes:
            return
        while self.num_bytes + len(data) > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= len(evicted)
            self.stats.evictions += 1
        self._entries[key] = data
        self.num_bytes += len(data)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
