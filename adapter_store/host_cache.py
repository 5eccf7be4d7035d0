"""The warm host-RAM tier: adapter bytes in an LRU bounded in bytes, in front of the blob store.

Concurrent requests for a cold adapter share one blob read (single-flight). Every blob read is
checked against the registry's sha256; a mismatch raises DataLoss and nothing is cached.
"""

import asyncio
import collections
import hashlib
import logging

from adapter_store.blobs import BlobStore
from adapter_store.registry import AdapterRecord
from loraplex.errors import DataLoss, NotFound

log = logging.getLogger(__name__)

_Key = tuple[str, int]  # (name, version); versions are immutable


class HostCache:
    """Whole adapters in host RAM, at most `capacity_bytes` in all (an adapter larger than that is
    served but not kept)."""

    def __init__(self, blobs: BlobStore, capacity_bytes: int):
        self._blobs = blobs
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._entries: collections.OrderedDict[_Key, bytes] = collections.OrderedDict()  # LRU first
        self._in_flight: dict[_Key, asyncio.Task[bytes]] = {}

    def __contains__(self, record: AdapterRecord) -> bool:
        return (record.name, record.version) in self._entries

    async def get(self, record: AdapterRecord) -> bytes:
        """The adapter's weights, from RAM or (once for all concurrent callers) the blob store."""
        key = (record.name, record.version)
        data = self._entries.get(key)
        if data is not None:
            self._entries.move_to_end(key)
            return data
        task = self._in_flight.get(key)
        if task is None:
            task = asyncio.create_task(self._load(record), name=f"load {record.weights_key}")
            self._in_flight[key] = task
            task.add_done_callback(lambda done: self._finish(key, done))
        # A cancelled caller must not cancel the read the others wait on.
        return await asyncio.shield(task)

    def _finish(self, key: _Key, task: asyncio.Task[bytes]) -> None:
        self._in_flight.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here too, so a read no caller waited for logs no warning

    async def _load(self, record: AdapterRecord) -> bytes:
        try:
            data = await self._blobs.get(record.weights_key)
        except NotFound:
            raise DataLoss(f"adapter {record.name!r} v{record.version} is registered but its "
                           "weights are missing from the blob store; push it again") from None
        digest = await asyncio.to_thread(_sha256, data)
        if len(data) != record.num_bytes or digest != record.sha256:
            log.error("%s: read %d bytes with sha256 %s, registry says %d bytes with %s",
                      record.weights_key, len(data), digest, record.num_bytes, record.sha256)
            raise DataLoss(f"adapter {record.name!r} v{record.version} is corrupted in the blob "
                           f"store (sha256 mismatch); push it again")
        self._insert((record.name, record.version), data)
        return data

    def _insert(self, key: _Key, data: bytes) -> None:
        if len(data) > self.capacity_bytes:
            return
        while self.num_bytes + len(data) > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= len(evicted)
        self._entries[key] = data
        self.num_bytes += len(data)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
