"""Residency leases: which adapter versions executors hold in GPU slots, as the store knows it.

Each executor reports its whole resident set (`ReportResidency`) after every load or unload and
every ttl/3 seconds. The replica that receives a report holds it in memory at once and writes it
to leases/{holder}.json in the shared blob store, the durable copy every replica reads. A report
expires `ttl_s` after it was made: an executor that dies stops pinning its adapters within one
ttl. Deleting a version is refused while an unexpired lease names it, in this replica's memory or
in the blob store. A load racing with a delete may still finish (the executor keeps serving from
its slot); the registry never hands the deleted version to a new request.

A frozen or down blob store must not let leases lapse: a report whose write does not finish
within WRITE_WAIT_S is acknowledged from memory and written on in the background (retried, the
latest report wins) until the blob store takes it. While a write is in doubt, and for one TTL
after the last failed one, this replica refuses deletions (UNAVAILABLE, retry later): another
replica's lease, or this one's, may be missing from the blob store. (A replica that saw no failed
write cannot know that another one did: a deletion it handles within one TTL of the blob store's
recovery may miss a lease that was only in the other replica's memory. The executor keeps
serving its slot either way.)
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import re
import time
from collections.abc import Callable

from adapter_store.blobs import BlobStore
from common.adapter_ref import AdapterRef
from common.errors import NotFound, Unavailable

log = logging.getLogger(__name__)

ROOT = "leases/"
# Matched with fullmatch: "$" would also accept a trailing newline.
_HOLDER_RE = re.compile(r"[A-Za-z0-9._:-]{1,200}")


def check_holder(holder: str) -> None:
    if not _HOLDER_RE.fullmatch(holder):
        raise ValueError(f"holder {holder!r} is invalid: 1-200 of A-Z a-z 0-9 . _ : -")


WRITE_WAIT_S = 2.0  # a report waits this long for its durable write, then is acked from memory
RETRY_S = 1.0  # a failed lease write is tried again this often


@dataclasses.dataclass(frozen=True)
class _Lease:
    adapters: frozenset[str]  # str(AdapterRef), as the durable copy stores them
    expires_unix: float


class LeaseBook:
    """Residency leases: this replica's memory in front of the blob store's durable copy."""

    def __init__(self, blobs: BlobStore, clock: Callable[[], float] = time.time):
        self._blobs = blobs
        self._clock = clock
        self._held: dict[str, _Lease] = {}  # holder -> its last report to this replica
        self._writers: dict[str, asyncio.Task] = {}  # holder -> its durable write in progress
        self._failed_at = -math.inf  # when a lease write last failed

    async def report(self, holder: str, adapters: list[AdapterRef], ttl_s: float) -> None:
        """Replace `holder`'s lease with `adapters` (empty removes it): in memory at once, in the
        blob store within WRITE_WAIT_S or in the background."""
        check_holder(holder)
        now = self._clock()
        for gone in [h for h, lease in self._held.items()  # holders that stopped reporting
                     if lease.expires_unix <= now and h not in self._writers]:
            del self._held[gone]
        self._held[holder] = _Lease(frozenset(map(str, adapters)), now + ttl_s)
        writer = self._writers.get(holder)
        if writer is None or writer.done():
            writer = self._writers[holder] = asyncio.create_task(self._write(holder))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WRITE_WAIT_S):
                await asyncio.shield(writer)

    async def _write(self, holder: str) -> None:
        """Write `holder`'s latest lease until the blob store has it (a newer report written
        meanwhile is written next)."""
        try:
            await self._write_until_written(holder)
        finally:
            self._writers.pop(holder, None)

    async def _write_until_written(self, holder: str) -> None:
        key = f"{ROOT}{holder}.json"
        while True:
            lease = self._held[holder]
            try:
                if lease.adapters:
                    await self._blobs.put(key, json.dumps({
                        "holder": holder, "adapters": sorted(lease.adapters),
                        "expires_unix": lease.expires_unix}).encode())
                else:
                    await self._blobs.delete(key)
            except Exception as err:  # noqa: BLE001 - unwritten, whatever the reason: retried
                self._failed_at = self._clock()
                log.warning("lease of %s not written (%s); held in memory, trying again", holder,
                            err)
                if lease.expires_unix <= self._clock():
                    return  # expired meanwhile: nothing left to pin
                await asyncio.sleep(RETRY_S)
                continue
            if self._held.get(holder) is lease:
                if not lease.adapters:
                    del self._held[holder]
                return

    def check_certain(self, ttl_s: float) -> None:
        """UNAVAILABLE while leases may be missing from the blob store (see the docstring)."""
        in_doubt = any(not w.done() for w in self._writers.values())
        if in_doubt or self._clock() - self._failed_at < ttl_s:
            raise Unavailable("residency leases could not all be written to the blob store "
                              "lately; deletions wait until they are: retry in a minute")

    async def holders_of(self, adapter: AdapterRef) -> list[str]:
        """Holders whose unexpired lease names `adapter`, here or in the blob store."""
        now = self._clock()
        held = {h for h, lease in self._held.items()
                if lease.expires_unix > now and str(adapter) in lease.adapters}
        keys = await self._blobs.list_keys(ROOT)

        async def read(key: str) -> dict | None:
            try:
                return json.loads(await self._blobs.get(key))
            except (NotFound, ValueError):
                return None  # removed meanwhile, or unreadable: it pins nothing

        leases = await asyncio.gather(*(read(k) for k in keys))
        stored = {lease["holder"] for lease in leases
                  if lease and lease.get("expires_unix", 0) > now
                  and str(adapter) in lease.get("adapters", ())}
        return sorted(held | stored)
