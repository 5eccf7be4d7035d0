"""Residency leases: which adapter versions executors hold in GPU slots, as the store knows it.

Each executor reports its whole resident set (`ReportResidency`) after every load or unload and
every ttl/3 seconds; the store that receives it writes leases/{holder}.json into the shared blob
store, so every replica sees it. A report expires `ttl_s` after it was written: an executor that
dies stops pinning its adapters within one ttl. Deleting a version is refused while an unexpired
lease names it. A load racing with a delete may still finish (the executor keeps serving from its
slot); the registry never hands the deleted version to a new request.
"""

import asyncio
import json
import re
import time

from adapter_store.blobs import BlobStore
from common.adapter_ref import AdapterRef
from common.errors import NotFound

ROOT = "leases/"
# Matched with fullmatch: "$" would also accept a trailing newline.
_HOLDER_RE = re.compile(r"[A-Za-z0-9._:-]{1,200}")


def check_holder(holder: str) -> None:
    if not _HOLDER_RE.fullmatch(holder):
        raise ValueError(f"holder {holder!r} is invalid: 1-200 of A-Z a-z 0-9 . _ : -")


class LeaseBook:
    """Reads and writes residency leases in the blob store."""

    def __init__(self, blobs: BlobStore):
        self._blobs = blobs

    async def report(self, holder: str, adapters: list[AdapterRef], ttl_s: float) -> None:
        """Replace `holder`'s lease with `adapters`; empty removes it."""
        check_holder(holder)
        key = f"{ROOT}{holder}.json"
        if not adapters:
            await self._blobs.delete(key)
            return
        lease = {"holder": holder, "adapters": sorted({str(a) for a in adapters}),
                 "expires_unix": time.time() + ttl_s}
        await self._blobs.put(key, json.dumps(lease).encode())

    async def holders_of(self, adapter: AdapterRef) -> list[str]:
        """Holders whose unexpired lease names `adapter`."""
        keys = await self._blobs.list_keys(ROOT)
        now = time.time()

        async def read(key: str) -> dict | None:
            try:
                return json.loads(await self._blobs.get(key))
            except (NotFound, ValueError):
                return None  # removed meanwhile, or unreadable: it pins nothing

        leases = await asyncio.gather(*(read(k) for k in keys))
        return sorted(lease["holder"] for lease in leases
                      if lease and lease.get("expires_unix", 0) > now
                      and str(adapter) in lease.get("adapters", ()))
