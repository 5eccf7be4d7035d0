"""Residency leases survive a blob store that stops answering: a report is acknowledged from the
receiving replica's memory and written on in the background; deletions wait while a lease may be
missing from the blob store."""

import asyncio

import pytest

from adapter_store import leases
from adapter_store.file_blobs import FileBlobStore
from adapter_store.leases import LeaseBook
from common.adapter_ref import AdapterRef
from common.errors import Unavailable

BOT = AdapterRef("bot", 1)


class FlakyBlobs(FileBlobStore):
    """A file blob store whose writes fail while `is_down` (a frozen or dead S3)."""

    is_down = False

    async def put(self, key, data, **conditions):
        if self.is_down:
            raise Unavailable("S3 unreachable (test)")
        await super().put(key, data, **conditions)

    async def delete(self, key):
        if self.is_down:
            raise Unavailable("S3 unreachable (test)")
        await super().delete(key)


async def test_a_report_during_an_outage_pins_from_memory_and_is_written_once_it_ends(
        tmp_path, monkeypatch):
    monkeypatch.setattr(leases, "WRITE_WAIT_S", 0.05)
    monkeypatch.setattr(leases, "RETRY_S", 0.02)
    now = [1000.0]
    blobs = FlakyBlobs(tmp_path)
    book = LeaseBook(blobs, clock=lambda: now[0])
    other_replica = LeaseBook(blobs, clock=lambda: now[0])
    blobs.is_down = True
    await asyncio.wait_for(book.report("exec-1", [BOT], ttl_s=30), 1.0)  # acked from memory
    assert await book.holders_of(BOT) == ["exec-1"]
    assert await other_replica.holders_of(BOT) == [], "not in the blob store yet"
    with pytest.raises(Unavailable, match="deletions wait"):
        book.check_certain(ttl_s=30)
    blobs.is_down = False
    for _ in range(100):  # the background write lands once the blob store answers
        if await other_replica.holders_of(BOT):
            break
        await asyncio.sleep(0.02)
    assert await other_replica.holders_of(BOT) == ["exec-1"]
    with pytest.raises(Unavailable):
        book.check_certain(ttl_s=30)  # one TTL after the last failed write: still in doubt
    now[0] += 31
    book.check_certain(ttl_s=30)
    await book.report("exec-1", [BOT], ttl_s=30)  # renewed after the doubt passed
    assert await other_replica.holders_of(BOT) == ["exec-1"]


async def test_an_empty_report_releases_and_the_latest_report_wins(tmp_path, monkeypatch):
    monkeypatch.setattr(leases, "WRITE_WAIT_S", 0.05)
    monkeypatch.setattr(leases, "RETRY_S", 0.02)
    blobs = FlakyBlobs(tmp_path)
    book = LeaseBook(blobs)
    blobs.is_down = True
    await book.report("exec-1", [BOT], ttl_s=30)
    await book.report("exec-1", [], ttl_s=30)  # released while the first write is in doubt
    assert await book.holders_of(BOT) == []
    blobs.is_down = False
    other = LeaseBook(blobs)
    for _ in range(100):
        if not any(not w.done() for w in book._writers.values()):
            break
        await asyncio.sleep(0.02)
    assert await other.holders_of(BOT) == [], "the release, not the stale lease, was written"
