"""The warm host-RAM tier: adapter bytes in an LRU bounded in bytes, in front of the blob store.

Concurrent requests for a cold adapter share one blob read (single-flight), and each of them
streams the read's pieces as they are cut from what arrives from the blob store, in order,
instead of waiting for the whole object. Pieces are what a Fetch sends: `piece_bytes` each (one
gRPC message), except the first `piece_bytes`, cut in HEAD_PIECES pieces so that the executor
starts receiving and hashing while the read goes on (1 MiB adapter, cold: 9.4 -> 7.6 ms), and the
object's last LAST_PIECE_BYTES, a piece of their own. Every blob read
is hashed as it arrives (in a worker thread, a batch at a time) and checked against the
registry's size and sha256; a mismatch is read again (a torn or flipped read in transit heals),
and after `read_attempts` mismatching reads raises DataLoss. Nothing that fails the check is
cached, and a follower never receives the last piece of a read that failed it: the newest piece
is held back until the next one arrives or the check passes, and after a failed read followers
get RESTART and the next read from its first byte. Keeping that last piece small lets the
executor receive and check the rest while this check finishes. (The executor checks size and
the version's CRC-32 before a byte goes to a GPU.)

The budget counts what reads in flight will hold as well as what is kept: a read that will be
kept reserves its adapter's size when it starts (evicting least recently used adapters to make
room), and turns the reservation into an entry when it is checked. When reads in flight reserve
so much that no eviction makes room, a read waits for them, at most `fill_wait_s`, then reads
through: it is served and not kept, as an adapter larger than the whole tier is. So entries and
reservations together never exceed `capacity_bytes`, however many cold adapters are read at once.
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
from common.adapter_ref import AdapterRef
from common.errors import DataLoss, NotFound

log = logging.getLogger(__name__)

_Parts = tuple[bytes, ...]  # an adapter's bytes, in the pieces a Fetch sends
_RETRY_DELAY_S = 0.05
LAST_PIECE_BYTES = 64 * 1024
HEAD_PIECES = 4  # the first piece_bytes go out in this many pieces: the executor starts sooner
_HASH_BATCH_BYTES = 256 * 1024  # arrived bytes hashed by one call in the worker thread


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
    read_through: int = 0  # reads served and not kept: larger than the tier, or no room in time


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
    """Whole adapters in host RAM, at most `capacity_bytes` in all, reads in flight included (an
    adapter larger than that, or one finding no room within `fill_wait_s`, is served but not
    kept)."""

    def __init__(self, blobs: BlobStore, capacity_bytes: int, read_attempts: int = 3,
                 piece_bytes: int = 1 << 20, fill_wait_s: float = 10.0):
        self._blobs = blobs
        self.capacity_bytes = capacity_bytes
        self.read_attempts = read_attempts
        self.piece_bytes = piece_bytes
        self.fill_wait_s = fill_wait_s
        self.num_bytes = 0  # of the entries
        self.reserved_bytes = 0  # of the reads in flight that will be kept
        self._room_freed = asyncio.Event()  # set (and replaced) when a reservation ends
        self.stats = CacheStats()
        # Least recently used first.
        self._entries: collections.OrderedDict[AdapterRef, _Parts] = collections.OrderedDict()
        self._in_flight: dict[AdapterRef, _Flight] = {}  # versions are immutable
        # Hashes each read's bytes in order while the next ones arrive (hashlib drops the GIL).
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sha256")

    def __contains__(self, record: AdapterRecord) -> bool:
        return record.ref in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def stream(self, record: AdapterRecord) -> AsyncIterator[bytes | Restart]:
        """The adapter's weights in pieces, from RAM or (one read for all concurrent callers)
        from the blob store as they arrive; RESTART means: drop what came before, start over.
        A blob read starts at this call, before the first piece is asked for."""
        parts = self._hit(record)
        if parts is not None:
            return _iterate(parts)
        return self._flight(record).follow()

    async def warm(self, record: AdapterRecord) -> None:
        """Bring the adapter into RAM (when it fits), reading it once for all concurrent callers."""
        if self._hit(record) is None:
            # A cancelled caller must not cancel the read the others wait on.
            await asyncio.shield(self._flight(record).task)

    def evict(self, adapter: AdapterRef) -> None:
        parts = self._entries.pop(adapter, None)
        if parts is not None:
            self.num_bytes -= sum(map(len, parts))

    def _evict_oldest(self) -> None:
        _, evicted = self._entries.popitem(last=False)
        self.num_bytes -= sum(map(len, evicted))
        self.stats.evictions += 1

    def _hit(self, record: AdapterRecord) -> _Parts | None:
        key = record.ref
        parts = self._entries.get(key)
        if parts is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
        return parts

    def _flight(self, record: AdapterRecord) -> _Flight:
        """The read of `record` in progress, started if there is none."""
        key = record.ref
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

    def _finish(self, key: AdapterRef, flight: _Flight, task: asyncio.Task[_Parts]) -> None:
        self._in_flight.pop(key, None)
        if task.cancelled():
            flight.fail(DataLoss(f"the read of {key} was cancelled; fetch again"))
        elif task.exception() is not None:  # retrieved here, so an unwatched read logs nothing
            flight.fail(task.exception())

    async def _load(self, record: AdapterRecord, flight: _Flight) -> _Parts:
        is_kept = await self._reserve(record.num_bytes)
        try:
            parts = await self._read_checked(record, flight)
        finally:
            if is_kept:
                self._unreserve(record.num_bytes)
        if is_kept:
            self._insert(record.ref, parts, record.num_bytes)  # in the room just unreserved
        return parts

    async def _reserve(self, num_bytes: int) -> bool:
        """Room for a read of `num_bytes` to be kept, reserved: made by evicting, or waited for
        (at most fill_wait_s) while reads in flight hold it. False: read it through."""
        if num_bytes > self.capacity_bytes:
            self.stats.read_through += 1
            return False
        try:
            async with asyncio.timeout(self.fill_wait_s):
                while not self._make_room(num_bytes):
                    await self._room_freed.wait()
        except TimeoutError:
            self.stats.read_through += 1
            log.warning("host tier: %d of its %d bytes are reserved by reads in flight after "
                        "%g s; a read of %d bytes goes through it, not kept", self.reserved_bytes,
                        self.capacity_bytes, self.fill_wait_s, num_bytes)
            return False
        self.reserved_bytes += num_bytes
        return True

    def _make_room(self, num_bytes: int) -> bool:
        """Evict least recently used entries until `num_bytes` fit beside the entries and the
        reservations; False (evicting nothing) when the reservations alone leave too little."""
        if self.reserved_bytes + num_bytes > self.capacity_bytes:
            return False
        while self.num_bytes + self.reserved_bytes + num_bytes > self.capacity_bytes:
            self._evict_oldest()
        return True

    def _unreserve(self, num_bytes: int) -> None:
        self.reserved_bytes -= num_bytes
        self._room_freed.set()
        self._room_freed = asyncio.Event()

    async def _read_checked(self, record: AdapterRecord, flight: _Flight) -> _Parts:
        """Read until a read matches the registry's size and sha256, at most read_attempts."""
        for attempt in range(1, self.read_attempts + 1):
            self.stats.blob_reads += 1
            if attempt > 1:
                flight.new_attempt()
            num_bytes, digest = await self._read(record, flight)
            self.stats.bytes_read += num_bytes
            if num_bytes == record.num_bytes and digest == record.sha256:
                parts = tuple(flight.parts)
                flight.verified()
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
        batch: list[bytes] = []
        cutter = _PieceCutter(record.num_bytes, self.piece_bytes, flight.add)

        def hash_batch() -> None:
            hashed.append(loop.run_in_executor(self._hasher, _update, digest, tuple(batch)))
            batch.clear()

        try:
            parts = self._blobs.iter_parts(record.weights_key)
            try:
                async for part in parts:
                    batch.append(part)
                    num_bytes += len(part)
                    if sum(map(len, batch)) >= _HASH_BATCH_BYTES:
                        hash_batch()
                    cutter.add(part)
                    if num_bytes > record.num_bytes:
                        break
            finally:
                await parts.aclose()
            if batch:
                hash_batch()
            cutter.finish()
        except NotFound:
            raise DataLoss(f"adapter {record.ref} is registered but its weights are missing "
                           "from the blob store; push it again") from None
        finally:
            await asyncio.gather(*hashed, return_exceptions=True)
        return num_bytes, digest.hexdigest()

    def _insert(self, key: AdapterRef, parts: _Parts, num_bytes: int) -> None:
        while (self.num_bytes + self.reserved_bytes + num_bytes > self.capacity_bytes
               and self._entries):
            self._evict_oldest()  # (never, with the room this read reserved)
        self._entries[key] = parts
        self.num_bytes += num_bytes


async def _iterate(parts: _Parts) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def _update(digest, parts: tuple[bytes, ...]) -> None:
    for part in parts:
        digest.update(part)


class _PieceCutter:
    """Cuts arriving bytes into the pieces of an object of `num_bytes`: `piece_bytes` each, the
    first `piece_bytes` in HEAD_PIECES pieces, the last LAST_PIECE_BYTES apart (bytes beyond
    `num_bytes` form one more piece at `finish`). A piece that is one whole arrived part is passed
    on as it is, else joined once."""

    def __init__(self, num_bytes: int, piece_bytes: int, emit) -> None:
        last_start = max(0, num_bytes - LAST_PIECE_BYTES)
        head = max(1, piece_bytes // HEAD_PIECES)
        self._ends = [*range(head, min(piece_bytes, last_start), head),
                      *range(piece_bytes, last_start, piece_bytes), last_start, num_bytes]
        self._ends = [end for end in dict.fromkeys(self._ends) if end > 0]  # [piece ends]
        self._next = 0  # index into _ends
        self._emit = emit
        self._pending: list[bytes | memoryview] = []
        self._offset = 0  # of the next byte to arrive

    def add(self, part: bytes) -> None:
        view, position = memoryview(part), 0
        while position < len(part):
            end = self._ends[self._next] if self._next < len(self._ends) else None
            take = len(part) - position if end is None else min(len(part) - position,
                                                                end - self._offset)
            self._pending.append(part if take == len(part) else view[position:position + take])
            position += take
            self._offset += take
            if self._offset == end:
                self._flush()
                self._next += 1

    def finish(self) -> None:
        if self._pending:
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        self._emit(pending[0] if len(pending) == 1 and isinstance(pending[0], bytes)
                   else b"".join(pending))
